"""Parsing engine and gateway metrics; the CLI's argument handling."""

from __future__ import annotations

import argparse
import asyncio
import contextlib

import httpx
import pytest
from kubellm.autoscaler import adapters, cli, observe

from kubellm import metrics
from tests.autoscaler.conftest import engine_text, gateway_text


def test_engine_load_sums_queues_and_averages_kv_over_engine_cores() -> None:
    text = (
        f"# TYPE {metrics.NUM_REQUESTS_WAITING} gauge\n"
        f'{metrics.NUM_REQUESTS_WAITING}{{engine="0"}} 3\n'
        f'{metrics.NUM_REQUESTS_WAITING}{{engine="1"}} 5\n'
        f"# TYPE {metrics.NUM_REQUESTS_RUNNING} gauge\n"
        f'{metrics.NUM_REQUESTS_RUNNING}{{engine="0"}} 7\n'
        f'{metrics.NUM_REQUESTS_RUNNING}{{engine="1"}} 1\n'
        f"# TYPE {metrics.KV_CACHE_USAGE} gauge\n"
        f'{metrics.KV_CACHE_USAGE}{{engine="0"}} 0.9\n'
        f'{metrics.KV_CACHE_USAGE}{{engine="1"}} 0.5\n'
        "# TYPE other_total counter\nother_total 12\n"
    )
    load = observe.engine_load(text, "pod-a")
    assert (load.name, load.fresh, load.waiting, load.running) == ("pod-a", True, 8, 8)
    assert load.kv_cache_usage == pytest.approx(0.7)


def test_engine_load_names_what_is_missing() -> None:
    text = engine_text(1, 2, 0.3).replace(metrics.KV_CACHE_USAGE, "something_else")
    with pytest.raises(observe.MetricsError, match="vllm:kv_cache_usage_perc"):
        observe.engine_load(text)
    with pytest.raises(observe.MetricsError, match="cannot parse"):
        observe.engine_load("this is { not prometheus")


def test_gateway_pending_per_model_deployment_and_namespace() -> None:
    text = gateway_text({"tiny": 2, "big": 7})
    assert observe.gateway_pending(text, "tiny") == 2
    assert observe.gateway_pending(text, "tiny", "tiny", "default") == 2
    assert observe.gateway_pending(text, "tiny", "tiny", "elsewhere") == 0
    assert observe.gateway_pending(text, "absent") == 0
    unlabelled = f'{metrics.GATEWAY_PENDING}{{model="tiny"}} 4\n'
    assert observe.gateway_pending(unlabelled, "tiny", "tiny", "default") == 4


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.configure(parser)
    return parser.parse_args(list(argv))


def test_cli_defaults_and_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    args = _args("--gateway-metrics-url", "http://gw:9000/metrics")
    assert (args.period, args.policy, args.gateway_metrics_url) == (
        5.0,
        "kv-queue",
        "http://gw:9000/metrics",
    )
    assert cli.run(_args("--policy", "nope")) == 2
    assert "--policy: unknown autoscaling policy 'nope'" in capsys.readouterr().err
    assert cli.run(_args("--period", "0")) == 2
    assert "--period must be positive" in capsys.readouterr().err


class _BrokenReplica:
    """A loopback engine whose answers are broken: `/flood` sends an endless body (up to
    64 MiB, counted in `sent`), `/trickle` one byte each 50 ms (until 20 s), and
    `/nested/v1/models` JSON nested 200,000 deep."""

    def __init__(self) -> None:
        self.sent = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        path = head.split(b" ", 2)[1]
        gone = asyncio.ensure_future(reader.read())  # done when the client hangs up
        try:
            if path == b"/nested/v1/models":
                body = b"[" * 200_000
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
                await writer.drain()
                await gone
                return
            writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n")
            chunk = b"x" * (1 << 20) if path == b"/flood" else b"#"
            for _ in range(64 if path == b"/flood" else 400):
                writer.write(chunk)
                await writer.drain()
                self.sent += len(chunk)
                if path == b"/trickle":
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(asyncio.shield(gone), 0.05)
                if gone.done():
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            gone.cancel()
            writer.close()


async def test_a_replica_that_floods_trickles_or_nests_its_answer_is_unknown() -> None:
    """The autoscaler reads every ready replica each period: an answer past 16 MiB, one
    still arriving after the scrape timeout, or JSON too deep to parse makes that replica
    unknown (None) instead of exhausting memory, stalling the loop or raising."""
    replica = _BrokenReplica()
    server = await asyncio.start_server(replica.handle, "127.0.0.1", 0)
    base = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        async with httpx.AsyncClient(timeout=1.0) as client:
            assert await observe.scrape(client, f"{base}/flood") is None
            assert replica.sent < 32 * (1 << 20)  # cut off near the limit, not read to the end
            assert await observe.scrape(client, f"{base}/trickle") is None
            assert await adapters.models(client, f"{base}/nested") is None
    finally:
        server.close()
        await server.wait_closed()


def test_a_replicas_data_parallel_ranks_fold_into_one_replica():
    from kubellm.autoscaler.policy import ReplicaMetrics as R

    ranks = [R("g0", True, waiting=2, running=4, kv_cache_usage=0.2),
             R("solo", True, waiting=1, running=1, kv_cache_usage=0.9),
             R("g0", True, waiting=3, running=6, kv_cache_usage=0.6),
             R("g1", True, waiting=5), R("g1", False)]  # fmt: skip
    assert observe.fold_ranks(ranks) == (
        R("g0", True, waiting=5, running=10, kv_cache_usage=0.4),
        R("solo", True, waiting=1, running=1, kv_cache_usage=0.9),
        R("g1", False),  # one rank unknown: the replica's load is unknown
    )
