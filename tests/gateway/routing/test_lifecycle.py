"""The request lifecycle (`routing.lifecycle.Ticket`), driven as a front end drives it:
one SLO definition for streamed and non-streamed answers and for both routes, slots
released exactly once, and the core's error answers."""

from __future__ import annotations

import asyncio
import json

import pytest
from kubellm.gateway.discovery.base import Endpoint, FixedDiscovery, ModelTarget
from kubellm.gateway.routing.admission import Thresholds
from kubellm.gateway.routing.router import routing_request
from kubellm.gateway.routing.scheduler import Scheduler, SchedulerSettings

from kubellm.api import SLO
from kubellm.contracts import FallbackTarget

A, B = "http://10.0.0.1:8000", "http://10.0.0.2:8000"
LABELS = {"model": "tiny", "deployment": "tiny", "namespace": "default"}


def _scheduler(*urls: str, fallback: bool = False, **settings: object) -> Scheduler:
    target = ModelTarget(
        "tiny", "tiny", endpoints=tuple(Endpoint(u) for u in urls),
        slo=SLO(ttft_seconds=1.0, itl_seconds=0.1),
        fallback=FallbackTarget("http://api.example/v1") if fallback else None,
    )  # fmt: skip
    return Scheduler(FixedDiscovery({"tiny": target}), SchedulerSettings(**settings))  # type: ignore[arg-type]


async def _ticket(scheduler: Scheduler, stream: bool, arrived: float = 100.0):  # type: ignore[no-untyped-def]
    target = scheduler.discovery.snapshot()["tiny"]
    routing = routing_request("tiny", {"prompt": "hi"}, None)
    return await scheduler.admit(target, routing, arrived=arrived, stream=stream)


def _value(scheduler: Scheduler, name: str, **labels: str) -> float:
    return scheduler.metrics.registry.get_sample_value(name, {**LABELS, **labels}) or 0.0


def _event(text: str) -> bytes:
    return b"data: " + json.dumps({"choices": [{"text": text}]}).encode() + b"\n\n"


def _answer(tokens: int) -> bytes:
    usage = {"prompt_tokens": 3, "completion_tokens": tokens}
    return json.dumps({"choices": [{"text": "x" * tokens}], "usage": usage}).encode()


@pytest.mark.parametrize("cut", ["whole events", "one chunk", "split mid-event"])
async def test_itl_counts_events_not_chunks(cut):
    """Four text events give three gaps however a proxy cuts the bytes."""
    scheduler = _scheduler(A)
    ticket = await _ticket(scheduler, stream=True)
    ticket.attempt(A).started()
    ticket.respond(200)
    events = [_event(f"t{i}") for i in range(4)] + [b"data: [DONE]\n\n"]
    if cut == "whole events":
        pieces = events
    elif cut == "one chunk":
        pieces = [b"".join(events)]
    else:
        data = b"".join(events)
        pieces = [data[i : i + 7] for i in range(0, len(data), 7)]
    for i, piece in enumerate(pieces):
        ticket.chunk(piece, now=100.1 + 0.01 * i)
    ticket.finish()
    assert _value(scheduler, "kubellm_gateway_inter_token_latency_seconds_count") == 3
    assert _value(scheduler, "kubellm_gateway_time_to_first_token_seconds_count") == 1
    assert _value(scheduler, "kubellm_gateway_slo_met_requests_total") == 1
    assert _value(scheduler, "kubellm_gateway_requests_total", target="replica", code="200") == 1


@pytest.mark.parametrize(
    ("elapsed", "tokens", "met"),
    [
        (0.9, 1, True),  # within the TTFT target
        (1.0 + 0.1 * 9 - 0.01, 10, True),  # the end of a stream that met both targets
        (1.0 + 0.1 * 9 + 0.01, 10, False),  # later than that
        (1.05, 1, False),  # one token: its TTFT alone
    ],
)
async def test_non_streamed_goodput_is_the_end_of_a_stream_meeting_both_targets(
    elapsed, tokens, met
):
    scheduler = _scheduler(A)
    ticket = await _ticket(scheduler, stream=False)
    ticket.attempt(A).started()
    ticket.respond(200)
    ticket.chunk(_answer(tokens), now=100.0 + elapsed)
    ticket.finish()
    assert _value(scheduler, "kubellm_gateway_slo_met_requests_total") == (1 if met else 0)
    assert _value(scheduler, "kubellm_gateway_time_to_first_token_seconds_count") == 1
    assert _value(scheduler, "kubellm_gateway_inter_token_latency_seconds_count") == 0


@pytest.mark.parametrize(
    ("stream", "status", "elapsed", "needed"),
    [
        (True, 200, 0.1, True),  # a stream's events give TTFT and ITL
        (False, 200, 0.9, False),  # within the TTFT target: met whatever its tokens
        (False, 200, 1.1, True),  # past it: its token count decides goodput
        (False, 400, 5.0, False),  # an error: nothing in its body counts
    ],
)
async def test_the_body_is_needed_only_where_it_counts(stream, status, elapsed, needed):
    """A front end that can stop following the answer asks the core first; an answer it
    did not follow counts as whole at its status line, exactly once."""
    scheduler = _scheduler(A)
    ticket = await _ticket(scheduler, stream=stream)
    attempt = ticket.attempt(A)
    attempt.started()
    ticket.respond(status)
    assert ticket.body_needed(100.0 + elapsed) is needed
    if not needed:
        ticket.body_unseen(100.0 + elapsed)
        ticket.finish()
        ticket.finish()
        assert scheduler.load.in_flight.get(A, 0) == 0
        counted = status == 200
        assert _value(scheduler, "kubellm_gateway_slo_met_requests_total") == counted
        assert _value(scheduler, "kubellm_gateway_time_to_first_token_seconds_count") == counted
        assert _value(scheduler, "kubellm_gateway_requests_total", target="replica",
                      code=str(status)) == 1  # fmt: skip


async def test_fallback_answers_need_their_body_for_its_tokens():
    scheduler = _scheduler(fallback=True, zero_replica_wait_seconds=0.0)
    ticket = await _ticket(scheduler, stream=False)
    ticket.respond(200)
    assert ticket.route == "fallback" and ticket.body_needed(100.1)
    ticket.finish()


@pytest.mark.parametrize("stream", [False, True])
async def test_fallback_answers_count_ttft_goodput_and_tokens(stream):
    scheduler = _scheduler(fallback=True, zero_replica_wait_seconds=0.0)
    ticket = await _ticket(scheduler, stream=stream)
    assert ticket.route == "fallback" and scheduler.fallback_in_flight["tiny"] == 1
    ticket.respond(200)
    if stream:
        ticket.chunk(_event("a") + _event("b"), now=100.2)
        usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}
        ticket.chunk(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n", 100.3)
    else:
        ticket.chunk(_answer(2), now=100.2)
    ticket.finish()
    ticket.finish()  # once
    assert scheduler.fallback_in_flight["tiny"] == 0
    assert _value(scheduler, "kubellm_gateway_time_to_first_token_seconds_count") == 1
    assert _value(scheduler, "kubellm_gateway_slo_met_requests_total") == 1
    assert _value(scheduler, "kubellm_gateway_fallback_tokens_total", kind="completion") == 2
    assert _value(scheduler, "kubellm_gateway_requests_total", target="fallback", code="200") == 1


async def test_one_attempt_holds_a_slot_at_a_time_and_finish_releases_it():
    scheduler = _scheduler(A, B)
    ticket = await _ticket(scheduler, stream=True)
    first = ticket.attempt(A)
    assert scheduler.in_flight() == {A: 1}
    assert (
        scheduler.metrics.registry.get_sample_value(
            "kubellm_gateway_endpoint_in_flight", {"url": A}
        )
        == 1
    )
    first.failed()
    ticket.attempt(B)
    ticket.attempt(A)  # moved again: B's slot is freed
    assert scheduler.in_flight() == {A: 1}
    ticket.finish()  # nothing reached the client: it left
    ticket.finish()
    assert scheduler.in_flight() == {}
    # an endpoint with nothing in flight has no series
    assert (
        scheduler.metrics.registry.get_sample_value(
            "kubellm_gateway_endpoint_in_flight", {"url": A}
        )
        is None
    )
    assert _value(scheduler, "kubellm_gateway_requests_total", target="none", code="499") == 1
    assert _value(scheduler, "kubellm_gateway_pending_requests") == 0


async def test_a_broken_stream_is_502_and_a_client_gone_keeps_its_status():
    scheduler = _scheduler(A)
    broken = await _ticket(scheduler, stream=True)
    broken.attempt(A).started()
    broken.respond(200)
    broken.chunk(_event("a"), now=100.1)
    broken.finish("upstream stream failed: ReadTimeout")
    gone = await _ticket(scheduler, stream=True)
    gone.attempt(A).started()
    gone.respond(200)
    gone.chunk(_event("a"), now=100.1)
    gone.finish(client_gone=True)
    assert _value(scheduler, "kubellm_gateway_requests_total", target="replica", code="502") == 1
    assert _value(scheduler, "kubellm_gateway_requests_total", target="replica", code="200") == 1
    assert _value(scheduler, "kubellm_gateway_slo_met_requests_total") == 0  # neither whole


async def test_refusals_carry_the_cores_retry_after_and_are_finished():
    scheduler = _scheduler(A, retry_after_seconds=7, thresholds=Thresholds(max_in_flight=1))
    held = await _ticket(scheduler, stream=True)
    held.attempt(A)
    scheduler.settings.max_queue = 0  # no waiting: refused at once
    refused = await _ticket(scheduler, stream=False)
    assert refused.done and refused.refusal is not None
    assert refused.refusal.status == 429 and refused.refusal.headers["Retry-After"] == "7"
    assert _value(scheduler, "kubellm_gateway_requests_total", target="none", code="429") == 1
    held.finish()


async def test_a_request_cancelled_while_queued_is_counted_499_once():
    scheduler = _scheduler(A, thresholds=Thresholds(max_in_flight=1))
    held = await _ticket(scheduler, stream=True)
    held.attempt(A)
    waiting = asyncio.ensure_future(_ticket(scheduler, stream=False))
    while not scheduler.queued.get("tiny"):
        await asyncio.sleep(0)  # let it reach the queue
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert _value(scheduler, "kubellm_gateway_requests_total", target="none", code="499") == 1
    assert _value(scheduler, "kubellm_gateway_pending_requests") == 1  # only the held one
    held.finish()
