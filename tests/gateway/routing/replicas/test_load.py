"""The load view: exact in-flight counts, scraped engine metrics, staleness, ejection."""

from __future__ import annotations

import math

import pytest
from kubellm.gateway.routing.replicas.load import (
    PREFILL_EWMA,
    EngineStats,
    LoadView,
    parse_engine_metrics,
    relevant_lines,
)
from kubellm.gateway.routing.replicas.outliers import OutlierDetector

VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 2.0
vllm:num_requests_waiting{engine="1",model_name="tiny"} 1.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.42
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 100.0
"""


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_parse_vllm_metrics_sums_engines():
    stats = parse_engine_metrics(VLLM_METRICS, scraped_at=1.0)
    assert (stats.running, stats.waiting, stats.kv_usage) == (3.0, 3.0, 0.42)


def test_release_callbacks_keep_counts_exact():
    view = LoadView()
    releases = [view.acquire("a") for _ in range(3)]
    view.acquire("b")
    assert view.in_flight == {"a": 3, "b": 1}
    releases[0]()
    releases[0]()  # a second call is a no-op
    assert view.in_flight["a"] == 2
    for release in releases[1:]:
        release()
    assert "a" not in view.in_flight


def test_stale_metrics_are_not_trusted():
    clock = Clock()
    view = LoadView(stale_after=5, clock=clock)
    view.record("a", parse_engine_metrics(VLLM_METRICS, clock()))
    view.acquire("a")
    assert view.load("a") == 7.0  # the engine's running + waiting, plus the 1 sent since
    clock.now += 6
    assert view.stats("a") is None
    assert view.load("a") == 1.0  # only what the gateway knows for sure


def test_load_corrects_the_last_scrape_by_what_this_gateway_did_since():
    clock = Clock()
    view = LoadView(stale_after=5, clock=clock)
    held = [view.acquire("a") for _ in range(2)]
    view.record("a", EngineStats(waiting=1, running=4, kv_usage=0.5, scraped_at=clock()))
    assert view.load("a") == 5.0  # our 2 are among the engine's 5
    held += [view.acquire("a") for _ in range(3)]  # a burst the scrape has not seen
    assert view.load("a") == 8.0
    for release in held[:4]:
        release()
    assert view.load("a") == 4.0  # 3 sent and 4 finished since the scrape: 5 - 1
    held[4]()
    view.record("a", EngineStats(waiting=0, running=0, kv_usage=0.0, scraped_at=clock()))
    view.acquire("a")
    assert view.load("a") == 1.0  # never below our own count


def test_ejection_period_grows_and_expires():
    clock = Clock()
    detector = OutlierDetector(threshold=2, base_seconds=10, max_seconds=25, clock=clock)
    assert not detector.failure("a")
    detector.success("a")  # a success resets the run of failures
    assert not detector.failure("a")
    assert detector.failure("a") and detector.ejected("a")
    clock.now += 10.5
    assert not detector.ejected("a")
    detector.failure("a")
    assert detector.failure("a")
    clock.now += 19
    assert detector.ejected("a")  # second ejection: 20 s
    clock.now += 2
    assert not detector.ejected("a")
    detector.failure("a")
    detector.failure("a")
    clock.now += 25.5
    assert not detector.ejected("a")  # third: 40 s capped at 25 s


async def test_stream_timing_starts_at_the_first_generated_text():
    from kubellm.gateway.discovery.base import Endpoint, FixedDiscovery, ModelTarget
    from kubellm.gateway.http.relay import relay
    from kubellm.gateway.routing.scheduler import Scheduler
    from kubellm.gateway.routing.scorers.base import RoutingRequest

    role = b'data: {"choices": [{"delta": {"role": "assistant", "content": ""}}]}\n\n'
    token = b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n'

    class Body:  # the upstream answer, one HTTP chunk per read
        def __init__(self) -> None:
            self.chunks = [token, token, b"data: [DONE]\n\n"]

        async def readchunk(self) -> bytes:
            return self.chunks.pop(0) if self.chunks else b""

    sent: list[bytes] = []

    async def send(message: dict) -> None:
        sent.append(message["body"])

    target = ModelTarget("m", "m", endpoints=(Endpoint("http://a"),))
    scheduler = Scheduler(FixedDiscovery({"m": target}))
    ticket = await scheduler.admit(target, RoutingRequest("m"), arrived=0.0, stream=True)
    # the role chunk was read first, by open_upstream
    broken = await relay(Body(), role, send, ticket)  # type: ignore[arg-type]
    assert b"".join(sent) == role + token + token + b"data: [DONE]\n\n"  # unchanged
    assert sent[-1] == b""  # the end of the body
    timing = ticket.timing
    assert broken is None and timing.chunks == 2 and len(timing.gaps) == 1


def test_a_fatal_failure_ejects_at_once():
    clock = Clock()
    detector = OutlierDetector(threshold=3, base_seconds=5, clock=clock)
    assert detector.failure("a", fatal=True) and detector.ejected("a")  # refused or frozen
    clock.now += 5.5
    assert not detector.ejected("a")


def test_a_replica_whose_scrape_failed_is_down_until_one_succeeds():
    clock = Clock()
    view = LoadView(stale_after=5, clock=clock)
    assert not view.down("a")  # never scraped yet: not down (routable at start)
    view.scrape_failed("a")
    assert view.down("a")
    view.record("a", EngineStats(waiting=0, running=0, kv_usage=0.0, scraped_at=clock()))
    assert not view.down("a")
    view.scrape_failed("a")
    view.forget(["b"])  # it left: nothing of it is kept
    assert not view.down("a")


def test_the_router_leaves_down_replicas_out_while_another_is_healthy():
    from kubellm.gateway.discovery.base import Endpoint, ModelTarget
    from kubellm.gateway.routing.replicas.outliers import OutlierDetector as Outliers
    from kubellm.gateway.routing.router import Router

    view = LoadView()
    router = Router(view, Outliers())
    target = ModelTarget("m", "m", endpoints=(Endpoint("http://a"), Endpoint("http://b")))
    view.scrape_failed("http://a")
    assert [c.url for c in router.candidates(target)] == ["http://b"]
    view.scrape_failed("http://b")  # every one down: route anyway (their metrics may be broken)
    assert {c.url for c in router.candidates(target)} == {"http://a", "http://b"}


def _gauges(waiting: str, running: str, kv: str) -> str:
    return (
        "# TYPE vllm:num_requests_waiting gauge\n"
        f'vllm:num_requests_waiting{{model_name="a"}} 2\n'
        f'vllm:num_requests_waiting{{model_name="b"}} {waiting}\n'
        "# TYPE vllm:num_requests_running gauge\n"
        f'vllm:num_requests_running{{model_name="a"}} {running}\n'
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        f'vllm:kv_cache_usage_perc{{model_name="a"}} {kv}\n'
    )


# (waiting, running, kv as the engine wrote them) -> what the gateway believes
FIGURES_TABLE = [
    (("1", "3", "0.5"), (3.0, 3.0, 0.5)),
    (("NaN", "NaN", "NaN"), (None, None, None)),
    (("-1", "-3", "-0.1"), (None, None, None)),
    (("+Inf", "+Inf", "+Inf"), (None, None, None)),
    (("-Inf", "-Inf", "1.5"), (None, None, None)),
    (("1e300", "1e300", "1e300"), (None, None, None)),
    (("999999", "5", "1"), (None, 5.0, 1.0)),  # the sum is past the bound
    (("0", "NaN", "0.2"), (2.0, None, 0.2)),  # one bad figure: only it is unknown
]


@pytest.mark.parametrize(("written", "believed"), FIGURES_TABLE)
def test_figures_outside_their_range_are_unknown(written, believed):
    stats = parse_engine_metrics(_gauges(*written), scraped_at=1.0)
    assert (stats.waiting, stats.running, stats.kv_usage) == believed
    view = LoadView(clock=lambda: 1.0)
    view.acquire("a")
    view.record("a", stats)
    load = view.load("a")
    assert math.isfinite(load) and load >= 1.0


COUNTERS = """\
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{{engine="0",model_name="tiny"}} {prompt}
vllm:prompt_tokens_created{{engine="0",model_name="tiny"}} 1.7e9
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{{engine="0",model_name="tiny"}} {generated}
vllm:generation_tokens_total{{engine="1",model_name="tiny"}} 5.0
"""


def test_token_counters_are_summed_and_a_bad_one_makes_them_unknown():
    stats = parse_engine_metrics(VLLM_METRICS + COUNTERS.format(prompt=10, generated=20), 0.0)
    assert stats.tokens == 35.0
    assert parse_engine_metrics(VLLM_METRICS, 0.0).tokens is None  # not exported
    for bad in ("NaN", "-1", "+Inf"):
        text = VLLM_METRICS + COUNTERS.format(prompt=10, generated=bad)
        assert parse_engine_metrics(text, 0.0).tokens is None, bad


def test_progress_is_when_the_token_counters_last_moved():
    clock = Clock()
    view = LoadView(clock=clock)
    assert view.progressed_since("a", 0.0) is None  # never scraped: unknown

    def scrape(tokens: float | None) -> None:
        view.record("a", EngineStats(0, 0, 0.0, scraped_at=clock(), tokens=tokens))

    scrape(10.0)
    assert view.progressed_since("a", clock.now) is True
    clock.now += 3
    scrape(10.0)  # standing still
    assert view.progressed_since("a", clock.now - 2) is False
    view.scrape_failed("a")  # a frozen process: no new scrape, no movement
    clock.now += 3
    assert view.progressed_since("a", clock.now - 5) is False
    scrape(11.0)
    assert view.progressed_since("a", clock.now) is True
    scrape(None)  # the counters are gone: unknown again
    assert view.progressed_since("a", 0.0) is None
    scrape(12.0)
    view.forget(["b"])
    assert view.progressed_since("a", 0.0) is None


PREFILL = """\
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{{engine="0",model_name="tiny"}} {prompt}
vllm:prompt_tokens_total{{engine="1",model_name="tiny"}} 1000
# TYPE vllm:request_prefill_time_seconds histogram
vllm:request_prefill_time_seconds_bucket{{engine="0",le="+Inf",model_name="tiny"}} 9
vllm:request_prefill_time_seconds_count{{engine="0",model_name="tiny"}} 9
vllm:request_prefill_time_seconds_sum{{engine="0",model_name="tiny"}} {seconds}
vllm:request_prefill_time_seconds_sum{{engine="1",model_name="tiny"}} 0.5
"""


def test_the_prefill_counters_are_read_through_the_scrape_filter():
    text = relevant_lines(VLLM_METRICS + PREFILL.format(prompt=3000, seconds=1.5))
    assert "_bucket" not in text  # only the histogram's sum is parsed
    assert parse_engine_metrics(text, 0.0).prefill == (4000.0, 2.0)
    assert parse_engine_metrics(VLLM_METRICS, 0.0).prefill is None  # not exported
    for prompt, seconds in (("NaN", "1"), ("10", "-1"), ("10", "+Inf")):
        text = relevant_lines(VLLM_METRICS + PREFILL.format(prompt=prompt, seconds=seconds))
        assert parse_engine_metrics(text, 0.0).prefill is None, (prompt, seconds)


BY_SOURCE = """\
# TYPE vllm:prompt_tokens_by_source counter
vllm:prompt_tokens_by_source_total{{engine="0",model_name="tiny",source="local_compute"}} {computed}
vllm:prompt_tokens_by_source_total{{engine="0",model_name="tiny",source="local_cache_hit"}} 2000
vllm:prompt_tokens_by_source_total{{engine="0",model_name="tiny",source="external_kv_transfer"}} 0
vllm:prompt_tokens_by_source_total{{engine="1",model_name="tiny",source="local_compute"}} 400
vllm:prompt_tokens_by_source_total{{engine="1",model_name="tiny",source="local_cache_hit"}} 600
"""


def test_the_prefill_speed_counts_only_computed_tokens_where_the_engine_says_them():
    # vLLM's prompt counter counts every prompt token, prefix-cache hits too, so a replica
    # whose prompts mostly hit would seem to prefill several times faster than it does;
    # `prompt_tokens_by_source{source="local_compute"}` counts what was computed.
    text = relevant_lines(
        VLLM_METRICS + PREFILL.format(prompt=3000, seconds=1.5) + BY_SOURCE.format(computed=1000)
    )
    assert parse_engine_metrics(text, 0.0).prefill == (1400.0, 2.0)
    bad = relevant_lines(
        VLLM_METRICS + PREFILL.format(prompt=3000, seconds=1.5) + BY_SOURCE.format(computed="NaN")
    )
    assert parse_engine_metrics(bad, 0.0).prefill is None


def test_a_replicas_prefill_speed_is_learnt_per_window_of_prefill():
    view = LoadView(clock=lambda: 0.0)

    def scrape(url: str, tokens: float, seconds: float) -> None:
        view.record(url, EngineStats(0, 0, 0.0, 0.0, prefill=(tokens, seconds)))

    scrape("a", 1000, 1.0)
    assert view.prefill_rate("a") is None  # nothing learnt from a first scrape
    scrape("a", 11_000, 2.0)  # 1 s of prefill: under a window
    assert view.prefill_rate("a") is None
    scrape("a", 21_000, 3.0)  # 2 s of prefill, 20,000 tokens
    assert view.prefill_rate("a") == pytest.approx(10_000)
    scrape("a", 41_000, 4.0)
    scrape("a", 81_000, 5.0)  # the next window: 60,000 tokens in 2 s
    assert view.prefill_rate("a") == pytest.approx(10_000 + PREFILL_EWMA * 20_000)
    scrape("a", 100, 0.1)  # restarted: its counters went back; the speed stays
    scrape("a", 300, 2.1)  # 200 tokens in 2 s: a slower window
    assert view.prefill_rate("a") < 10_000 + PREFILL_EWMA * 20_000
    scrape("b", 0, 0.0)
    scrape("b", 0, 5.0)  # time without tokens says nothing
    assert view.prefill_rate("b") is None
    view.forget(["b"])
    assert view.prefill_rate("a") is None
