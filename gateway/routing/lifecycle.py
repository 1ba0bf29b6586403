"""The life of one request in the routing core: admission returns a `Ticket`, and the
front ends translate their protocol into a handful of calls on it.

    ticket = await scheduler.admit(target, routing, arrived=t0, stream=s)
    ticket.refusal                    # the core's error answer (429/503 + Retry-After), or None
    ticket.route                      # "replica", "fallback" or "none"
    for url in ticket.urls():         # replica route: best first
        attempt = ticket.attempt(url) # holds an in-flight slot on the replica
        attempt.failed(fatal=...)     # no usable start: outlier feedback, slot freed
        attempt.started()             # it answers: prefix/session recorded
    ticket.respond(status)            # the answer's status line
    ticket.chunk(data)                # each body piece, as it passes to the client
    ticket.tap = tap                  # optional: sees each piece and the end (the mirror's)
    ticket.body_needed(now)           # after respond: does the core still need the body?
    ticket.body_unseen(now)           # the front end will not follow it: the end is now
    ticket.fail(error)                # the answer is an error the core chose (caller renders)
    ticket.generated(events)          # a non-streamed answer's events read when its client left
    ticket.finish(broken=...)         # the end: exactly once, whatever happened

Everything about the request lives here, once for both front ends: the request record
(pending gauge, requests by route and status, end-to-end time), the in-flight slots (one
replica attempt at a time) and the fallback concurrency slot, outlier feedback (a failure
before the first byte, or a break after it; a success once an answer ended whole), prefix and
adapter recording, the completion rate that predicts queue waits, and the SLO outcome:

- TTFT: arrival to the first event carrying generated text (streams), or to the whole
  answer (non-streamed: what the client sees; the HTTP front end assembles it from the
  replica's stream and passes it here as one piece, the endpoint picker's Envoy relays
  it whole), on every route;
- ITL: the gaps between events carrying text, per event, not per network chunk (events
  that arrive in one chunk are 0 s apart), so the count does not depend on how a proxy
  cuts the bytes; a non-streamed answer has none (the client got no events);
- goodput: a 200 answer that ended whole, its TTFT within the target, and its mean ITL
  within the target; for a non-streamed answer of n completion tokens the gateway sees
  only the end, so it counts when it arrived within TTFT target + ITL target x (n - 1):
  the end of a stream that met both targets;
- fallback tokens: the `usage` of a fallback answer (the JSON body, or a stream's usage
  event), by kind.

`finish` releases every slot and counts the outcome once; later calls do nothing, so a
front end calls it from every exit (a client gone, an exception, a stream closed early).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from kubellm.gateway.discovery.base import ModelTarget
from kubellm.gateway.protocol import errors, sse, usage
from kubellm.gateway.protocol.errors import GatewayError
from kubellm.gateway.routing.admission import Route
from kubellm.gateway.routing.canary import revisions
from kubellm.gateway.routing.latency.metrics import TOKEN, RequestRecord, StreamTiming
from kubellm.gateway.routing.scorers.base import Candidate, RoutingRequest

if TYPE_CHECKING:
    from kubellm.gateway.routing.dispatch import Decision
    from kubellm.gateway.routing.flow.controller import Caller
    from kubellm.gateway.routing.scheduler import Scheduler

log = logging.getLogger("kubellm.gateway")

# The response header both front ends set: which route answered (replica, fallback).
ROUTE_HEADER = "x-kubellm-route"

# A non-streamed answer is kept for its `usage` up to this size (a larger one counts no
# tokens); an SSE event split across chunks is kept as `sse.Framer` bounds it.
USAGE_BYTES = 4 * 1024 * 1024


class Attempt:
    """One try of a request on one replica: holds its in-flight slot until it fails, is
    replaced, or the ticket finishes."""

    __slots__ = ("_release", "ticket", "url")

    def __init__(self, ticket: Ticket | None, url: str, release: Callable[[], None]) -> None:
        self.ticket = ticket
        self.url = url
        self._release: Callable[[], None] | None = release

    def release(self) -> None:
        """Free the in-flight slot (once)."""
        release, self._release = self._release, None
        if release is not None:
            release()

    def failed(self, fatal: bool = False) -> None:
        """No usable start (error, 5xx, timeout before the first byte): counts toward the
        replica's ejection (`fatal`, refused or frozen: at once) and frees the slot."""
        if self.ticket is not None:
            self.ticket._core.failed(self.url, fatal=fatal)
            if self.ticket._attempt is self:
                self.ticket._attempt = None
        self.release()

    def abandon(self) -> None:
        """The request ended while this attempt was under way (the client left): no health
        verdict on the replica, the slot freed."""
        if self.ticket is not None and self.ticket._attempt is self:
            self.ticket._attempt = None
        self.release()

    def started(self) -> None:
        """The replica answers (a first byte, or a status under 500): the request is
        recorded there (prefix index, session, prefix match). Its outlier verdict waits for
        the end (`Ticket.finish`): a stream that breaks after its first byte is a failure."""
        ticket = self.ticket
        if ticket is None:
            return
        ticket.served = self.url
        if not ticket._recorded:
            ticket._recorded = True
            core = ticket._core  # prefix affinity, and how much of the prompt matched there
            ratio = core.router.routed(ticket.routing, self.url, ticket.urls)
            core.metrics.of(ticket.target).prefix_match.observe(ratio)


class Tap(Protocol):
    """Sees a request's answer as it passes (`Ticket.tap`): each body piece, then the end
    (`whole`: a 200 answer that ended whole). Must not raise or block."""

    def feed(self, data: bytes) -> None: ...

    def end(self, whole: bool) -> None: ...


class Ticket:
    """One request, from admission to its end; see the module."""

    __slots__ = (
        "_attempt",
        "_body",
        "_core",
        "_events",
        "_fallback",
        "_recorded",
        "_size",
        "_usage",
        "arrived",
        "caller",
        "dispatch",
        "done",
        "good",
        "hold",
        "order",
        "reason",
        "record",
        "refusal",
        "route",
        "routing",
        "sent",
        "served",
        "status",
        "stream",
        "tap",
        "target",
        "timing",
        "ttft",
    )  # fmt: skip

    def __init__(
        self,
        core: Scheduler,
        target: ModelTarget,
        routing: RoutingRequest,
        arrived: float,
        stream: bool,
    ) -> None:
        self._core = core
        self.target = target
        self.routing = routing
        self.arrived = arrived
        self.stream = stream
        self.record = RequestRecord(core.metrics.of(target), arrived)
        self.route = "none"
        self.reason = ""
        self.order: Sequence[Candidate] = ()
        self.refusal: GatewayError | None = None
        self.status = 0  # the answer's status line, once known
        self.served: str | None = None  # the replica that answers
        self.sent = False  # a replica received the request (it may have worked on it)
        self.done = False
        self.timing = StreamTiming(arrived)
        self._attempt: Attempt | None = None
        self._fallback: Callable[[], None] | None = None
        self._recorded = False
        self._body: list[bytes] | None = None if stream else []  # kept, not copied
        self._size = 0
        self._events = sse.Framer() if stream else None  # a stream's events, whole
        self._usage: dict[str, int] | None = None
        # the current attempt's, for the gates (routing/gates): the latency prediction's
        # (url, features at dispatch, when sent, streaming yet, what its first token
        # taught the model), and the replica this request holds low bands off while its
        # prefill runs (tenancy)
        self.dispatch: list[Any] | None = None
        self.hold: str | None = None
        self.caller: Caller | None = None  # its tenant (tenancy.py), when tenants are declared
        self.good = False  # the answer met the SLO (goodput)
        self.ttft: float | None = None  # the TTFT counted in the model's series, if any
        # sees the answer's pieces and its end (the canary mirror's reference answer)
        self.tap: Tap | None = None

    # ------------------------------------------------------------ admission (the core's)

    def _admitted(self, decision: Decision, target: ModelTarget) -> None:
        core = self._core
        self.target = target
        reason = self.reason = decision.reason
        if decision.route is Route.REPLICA:
            self.route = "replica"
            self.order = decision.order
        elif decision.route is Route.FALLBACK:
            self.route = "fallback"
            self._fallback = core.fallback_in_flight.hold(target.served_name)
            core.metrics.fallback.labels(*self.record.series.labels, reason).inc()
        else:  # saturated (or shed by flow control): 429, come back soon; no replica: 503
            status = 503 if reason == "no-ready-replicas" else 429
            retry = core.settings.retry_after_seconds
            self.fail(errors.overloaded(target.served_name, retry, status, decision.loading))
            if self.caller is not None and core.tenancy is not None:  # its tenant's drop
                core.tenancy.dropped(self.caller, reason, self.refusal)

    # ------------------------------------------------------------ the front end's calls

    def urls(self, allowed: Callable[[str], bool] | None = None) -> list[str]:
        """The replicas to try, best first (`allowed`: a front end's own restriction)."""
        return [c.url for c in self.order if allowed is None or allowed(c.url)]

    def attempt(self, url: str) -> Attempt:
        """Send the request to replica `url`: counts it there (the previous attempt's slot,
        if still held, is freed: one attempt holds a slot at a time)."""
        if self._attempt is not None:
            self._attempt.abandon()
        hooks = self._core.hooks
        for over in hooks.over:
            over(self)
        for sent in hooks.sent:
            sent(self, url)
        attempt = self._attempt = Attempt(self, url, self._core.load.acquire(url))
        self.sent = True
        tenant = self.caller.tenant.name if self.caller is not None else None
        revisions.attribute(self.record, self.target, url, self.routing, tenant)  # analysis
        if self.done:  # finished meanwhile: nothing may stay held
            attempt.release()
        return attempt

    def respond(self, status: int) -> None:
        """The answer's status line is known (it is being sent to the client)."""
        self.status = status

    def body_needed(self, now: float) -> bool:
        """Once the status line is known (`respond`): whether the core still needs the
        answer's body. A stream's events give TTFT, ITL and its usage; a non-streamed 200
        answer's body is read only for its `usage`: a fallback answer's tokens, a tenant's
        token counts, and goodput past the TTFT target (its token budget). Otherwise (an
        error status, or a replica's 200 within the TTFT target, no tenant) the status line
        is all the core reads, and a front end that can stop following the body (the
        endpoint picker: Envoy's ext_proc mode override) may."""
        if self.stream:
            return True
        if self.status != 200:
            return False
        if self.route == "fallback" or self.caller is not None:
            return True
        return now - self.arrived > self.target.slo.ttft_seconds

    def body_unseen(self, now: float) -> None:
        """The front end will not see the body (`body_needed` said it need not): a
        non-streamed answer counts as whole at `now`, its status line, for TTFT, goodput
        and the end-to-end time the front end's `finish` records."""
        if self._body is not None:
            self.timing.last = now

    def chunk(self, data: bytes, now: float | None = None) -> None:
        """A piece of the answer's body passed to the client at `now`."""
        if not data:
            return
        if self.tap is not None:
            self.tap.feed(data)
        if self._body is not None:  # non-streamed: the whole answer is its first token
            self._body_piece(data, time.monotonic() if now is None else now)
            return
        events: sse.Framer = self._events  # type: ignore[assignment]  # streams have one
        if not events.whole(data):  # an event spans pieces
            data = events.feed(data)[0]
            if not data:
                return
        # (the usual piece is one whole event: one search, no list of matches)
        if TOKEN.search(data) is not None:
            now = time.monotonic() if now is None else now
            timing = self.timing
            if timing.first is None:  # the attempt's prefill is done
                for first_token in self._core.hooks.first_token:
                    first_token(self, now)
            if data.count(b"\n\n") == 1:
                timing.token(now)
            else:  # ITL per event: the events of one piece arrived together
                for _ in range(len(TOKEN.findall(data))):
                    timing.token(now)
        if b'"usage"' in data:
            self._stream_usage(data)

    def _body_piece(self, data: bytes, now: float) -> None:
        self.timing.last = now
        self._size += len(data)
        if self._size <= USAGE_BYTES:
            self._body.append(data)  # type: ignore[union-attr]
        else:
            self._body.clear()  # type: ignore[union-attr]  # too large to read its usage

    def fail(self, error: GatewayError) -> GatewayError:
        """The answer is `error` (the core's words, rendered by the front end): counted
        with the route the request took, and finished. Returns `error`."""
        if self.refusal is None:
            self.refusal = error
        self.status = error.status
        self.finish()
        return error

    def attempts_failed(self, tried: int) -> GatewayError:
        """Every replica tried gave no usable answer: a 502 in the core's words."""
        return self.fail(
            errors.upstream_failed(
                f"No replica of `{self.target.served_name}` answered ({tried} tried)."
            )
        )

    def finish(self, broken: str | None = None, client_gone: bool = False) -> None:
        """The exchange ended: whole, or not (`broken`: why the upstream's answer broke
        off, counted 502 when it had started well; `client_gone`: the client left
        mid-answer, its status kept, no goodput). Nothing reached the client yet: 499.
        Frees every slot and counts the outcome once; later calls do nothing."""
        if self.done:
            return
        self.done = True
        if self._attempt is not None:
            self._attempt.release()
            self._attempt = None
        if self._fallback is not None:
            self._fallback()
            self._fallback = None
        status = self.status
        if not status:  # nothing reached the client: it left
            self._over(False)
            self.record.finish("none", 499)
            self._ended()
            self._tapped(False)
            return
        if broken is not None:
            self.timing.failed(broken)
        core = self._core
        if self.served is not None and status < 500:
            core.completions.record(self.served)  # the rate that predicts queue waits
        if self.served is not None:
            self._verdict(broken is not None or status == 502, client_gone)
        whole = self.refusal is None and broken is None and not client_gone
        if self.refusal is None:
            try:
                self._observe(status, whole)
            except Exception:  # the answer and its record stand whatever the accounting does
                log.exception("the SLO accounting of a request failed")
        self._over(whole and status == 200)
        if broken is not None and status < 400:
            status = 502  # the answer started and broke: a server-side failure
        self.record.finish(self.route, status)
        self._ended()
        self._tapped(whole and status == 200)

    def _tapped(self, whole: bool) -> None:
        tap, self.tap = self.tap, None
        if tap is not None:
            try:
                tap.end(whole and self.status == 200)
            except Exception:  # the request's record stands whatever the tap does
                log.exception("a tap on a request's answer failed")

    def _ended(self) -> None:
        for ended in self._core.hooks.ended:
            try:
                ended(self)
            except Exception:  # the request's record stands whatever the accounting does
                log.exception("the tenant accounting of a request failed")

    def generated(self, events: int) -> None:
        """A non-streamed answer the client left mid-way had this many events carrying
        text when it left (the front end read them, the client got none): served."""
        self.timing.chunks += events

    def served_tokens(self) -> tuple[int, int] | None:
        """What the request was served, (prompt, completion) tokens: its upstream's
        checked `usage` where it sent one, else the gateway's count (the caller's prompt
        estimate, the events that carried text). None where nothing was served: no
        upstream received it, or it answered an error. A request an upstream received is
        served even when its client left before the answer (the prompt, and what came)."""
        received = self.sent or self.route == "fallback"
        if self.status != 200 and not (self.status == 0 and received):
            return None
        found = self._usage
        if self._body is not None and self.status == 200:
            found = usage.parse(b"".join(self._body))
        estimate = self.caller.estimate if self.caller is not None else 0
        if found is not None:
            return found["prompt"] or estimate, found["completion"]
        return estimate, self.timing.chunks

    # ------------------------------------------------------------ the gates'

    def _over(self, learn: bool) -> None:
        """The current attempt owes no more prefill (`learn`: the answer ended whole)."""
        for over in self._core.hooks.over:
            over(self, learn)

    def _verdict(self, failed: bool, client_gone: bool) -> None:
        """The outlier verdict on the replica that answered, at the end of its answer: a
        success only when it ended whole; a break after the first byte (or the 502 the
        gateway answered for it) a failure, whose TTFT the model takes back. A replica that
        sends one token at once and drops the connection is neither reset to healthy by
        its first bytes nor learnt as the fastest."""
        core, url = self._core, self.served
        assert url is not None
        if failed:
            core.failed(url)
            dispatch = self.dispatch
            if dispatch is not None and dispatch[0] == url and dispatch[3]:
                core.predictions.broken(url, dispatch[1], dispatch[4])
        elif not client_gone:
            core.outliers.success(url)

    # ------------------------------------------------------------ the SLO outcome

    def _observe(self, status: int, whole: bool) -> None:
        series = self.record.series
        slo = self.target.slo
        timing = self.timing
        counts = self._usage or {}
        if self._body is not None:  # non-streamed
            if status != 200 or timing.last is None:
                return
            ttft = self.ttft = timing.last - self.arrived
            series.ttft.observe(ttft)
            # within the TTFT target the answer met its SLO whatever its token count: the
            # body is parsed only past it, or for a fallback answer's tokens
            if self.route == "fallback" or ttft > slo.ttft_seconds:
                counts = usage.parse(b"".join(self._body)) or {}
            budget = slo.ttft_seconds + slo.itl_seconds * max(counts.get("completion", 0) - 1, 0)
            met = whole and ttft <= max(slo.ttft_seconds, budget)
            if met:
                series.goodput.inc()
            self.record.revision_observed(ttft, (), met, streamed=False)
            self.good = met
        else:
            self.ttft = timing.ttft
            if timing.ttft is not None:
                series.ttft.observe(timing.ttft)
            series.itl.observe_all(timing.gaps)
            completed = whole and status == 200 and timing.first is not None
            met = completed and met_slo(
                timing.ttft, timing.mean_itl, slo.ttft_seconds, slo.itl_seconds
            )
            if met:
                series.goodput.inc()
            self.record.revision_observed(timing.ttft, timing.gaps, met)
            self.good = met
        if self.route == "fallback" and status == 200 and counts:
            metric = self._core.metrics.fallback_tokens
            for kind, count in counts.items():
                if count:
                    metric.labels(*series.labels, kind).inc(count)

    def _stream_usage(self, events: bytes) -> None:
        found = usage.in_events(events)
        if found is not None:
            self._usage = found


def met_slo(
    ttft: float | None, mean_itl: float | None, ttft_target: float, itl_target: float
) -> bool:
    """Goodput test for one whole answer: TTFT and mean ITL within their targets."""
    if ttft is None or ttft > ttft_target:
        return False
    return mean_itl is None or mean_itl <= itl_target
