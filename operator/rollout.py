"""Pure canary rollouts: the analysis verdict, the replica split, and the state machine.

No I/O here. The reconciler observes (the stable Deployment's revision, whether each
Deployment is ready, the gateway's per-revision counters, the abort/promote
annotation), calls `decide`, and applies what it returns:

- `rolling`: no canary; the engine Deployment follows the spec (its own rolling update);
- `canary`: the stable Deployment is left as it is except its replicas; a second
  Deployment runs the spec's revision with `canary_replicas`;
- `promoting`: the stable Deployment takes the spec's revision (rolling update) while the
  canary keeps serving at its last size; once the stable one is ready, the canary goes.

Phases in `status.rollout.phase`: Stable -> Progressing (step 1..n; each step waits for
the canary to be ready, then holds the analysis for pauseSeconds) -> Promoting -> Stable;
a failed analysis or an abort goes to RolledBack (canary at zero, 100% stable) and stays
there until the spec names another revision or a person promotes.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from kubellm import api
from kubellm.contracts import ROLLOUT_ACTION_ANNOTATION

Mode = Literal["rolling", "canary", "promoting"]
Result = Literal["Pass", "Fail", "Inconclusive"]


# --------------------------------------------------------------------------- figures


@dataclass(frozen=True)
class Counters:
    """One revision's cumulative counters at the gateway (or their change over a window)."""

    requests: float = 0.0  # answered by a replica of the revision
    errors: float = 0.0  # of those, failed (5xx, stream errors)
    slo_met: float = 0.0  # of those, met slo.ttftSeconds and slo.itlSeconds
    ttft_sum: float = 0.0
    ttft_count: float = 0.0
    itl_sum: float = 0.0
    itl_count: float = 0.0

    def minus(self, earlier: Counters | None) -> Counters:
        """The change since `earlier`; a counter that went down (a gateway restart) counts
        from zero, as Prometheus' increase() does."""
        if earlier is None:
            return self
        values = {}
        for key, now in asdict(self).items():
            before = getattr(earlier, key)
            values[key] = now - before if now >= before else now
        return Counters(**values)

    def plus(self, other: Counters) -> Counters:
        return Counters(**{k: v + getattr(other, k) for k, v in asdict(self).items()})

    def to_status(self) -> dict[str, float]:
        return {k: float(v) for k, v in asdict(self).items()}

    @classmethod
    def from_status(cls, data: Mapping[str, Any] | None) -> Counters | None:
        if not isinstance(data, Mapping):
            return None
        known = {k: float(data[k]) for k in asdict(cls()) if isinstance(data.get(k), int | float)}
        return cls(**known)

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    @property
    def ttft(self) -> float | None:
        return self.ttft_sum / self.ttft_count if self.ttft_count else None

    @property
    def itl(self) -> float | None:
        return self.itl_sum / self.itl_count if self.itl_count else None

    def burn_rate(self, objective: float) -> float:
        """Error-budget burn: the share missing the SLO over the share the objective allows."""
        if not self.requests:
            return 0.0
        missed = max(0.0, self.requests - self.slo_met) / self.requests
        return missed / (1.0 - objective)

    def figures(self) -> dict[str, Any]:
        """`status.rollout.verdict.canary|stable` (api.RevisionFigures)."""
        out: dict[str, Any] = {
            "requests": int(self.requests),
            "errors": int(self.errors),
            "sloMet": int(self.slo_met),
        }
        if self.ttft is not None:
            out["ttftSeconds"] = round(self.ttft, 6)
        if self.itl is not None:
            out["itlSeconds"] = round(self.itl, 6)
        return out


@dataclass(frozen=True)
class Verdict:
    result: Result
    reason: str
    message: str
    canary: Counters | None = None
    stable: Counters | None = None

    def to_status(self, now: str) -> dict[str, Any]:
        out: dict[str, Any] = {
            "result": self.result,
            "reason": self.reason,
            "message": self.message,
            "time": now,
        }
        if self.canary is not None:
            out["canary"] = self.canary.figures()
        if self.stable is not None:
            out["stable"] = self.stable.figures()
        return out


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 1000:.0f} ms"


def analyse(
    canary: Counters | None,
    stable: Counters | None,
    analysis: api.RolloutAnalysis,
    slo: api.SLO,
) -> Verdict:
    """The canary's verdict over one window (figures in, verdict out).

    Inconclusive until the canary answered `minRequests`; then Fail on the first check it
    breaks (error rate over stable's + maxErrorRate; mean TTFT or ITL over max...Ratio x
    stable's, when stable has figures to compare with; burn rate more than maxBurnRate over
    stable's), else Pass."""
    if canary is None:
        return Verdict(
            "Inconclusive",
            "NoFigures",
            "no per-revision figures from the gateway yet (is the operator's "
            "--gateway-metrics-url set?); the step waits, or `kubellm rollout promote`",
        )
    if canary.requests < analysis.min_requests:
        return Verdict(
            "Inconclusive",
            "TooFewRequests",
            f"the canary answered {canary.requests:.0f} of the {analysis.min_requests} "
            "requests a verdict needs (spec.rollout.analysis.minRequests)",
            canary,
            stable,
        )
    stable_errors = stable.error_rate if stable is not None else 0.0
    if canary.error_rate > stable_errors + analysis.max_error_rate:
        return Verdict(
            "Fail",
            "CanaryErrorRate",
            f"the canary failed {canary.error_rate:.1%} of {canary.requests:.0f} requests, "
            f"stable {stable_errors:.1%} (allowed: {analysis.max_error_rate:.1%} more, "
            "spec.rollout.analysis.maxErrorRate); see the canary pods' logs",
            canary,
            stable,
        )
    checks = (
        ("TTFT", canary.ttft, stable.ttft if stable else None, analysis.max_ttft_ratio,
         "maxTTFTRatio"),
        ("ITL", canary.itl, stable.itl if stable else None, analysis.max_itl_ratio,
         "maxITLRatio"),
    )  # fmt: skip
    for name, mine, theirs, limit, knob in checks:
        if mine is not None and theirs:
            ratio = mine / theirs
            if ratio > limit:
                return Verdict(
                    "Fail",
                    f"Canary{name}Regression",
                    f"the canary's mean {name} is {ratio:.2f}x the stable revision's "
                    f"({_ms(mine)} vs {_ms(theirs)} over {canary.requests:.0f} requests; "
                    f"allowed {limit:g}x, spec.rollout.analysis.{knob}); check the new "
                    "revision's engine settings (quantization, kvCacheDtype, image)",
                    canary,
                    stable,
                )
    burn = canary.burn_rate(slo.objective)
    stable_burn = stable.burn_rate(slo.objective) if stable is not None else 0.0
    if burn - stable_burn > analysis.max_burn_rate:
        return Verdict(
            "Fail",
            "CanarySLOBurn",
            f"the canary burns its SLO error budget at {burn:.1f}x (stable {stable_burn:.1f}x, "
            f"allowed {analysis.max_burn_rate:g} more, spec.rollout.analysis.maxBurnRate): "
            f"{canary.requests - canary.slo_met:.0f} of {canary.requests:.0f} requests missed "
            f"ttft {slo.ttft_seconds:g} s or itl {slo.itl_seconds:g} s",
            canary,
            stable,
        )
    return Verdict(
        "Pass",
        "AnalysisPassed",
        f"over {canary.requests:.0f} requests: errors {canary.error_rate:.1%} (stable "
        f"{stable_errors:.1%}), TTFT {_ms(canary.ttft)} (stable "
        f"{_ms(stable.ttft if stable else None)}), ITL {_ms(canary.itl)} (stable "
        f"{_ms(stable.itl if stable else None)}), burn {burn:.1f}x",
        canary,
        stable,
    )


# --------------------------------------------------------------------------- sizing


def split(total: int, weight: int) -> tuple[int, int]:
    """(stable, canary) replicas for `total` (the /scale value) and the canary's weight in
    percent: each revision's share of capacity follows its share of traffic, rounded up,
    and a canary with weight gets at least one replica (so the sum may pass total by one)."""
    if total <= 0:
        return 0, 0
    if weight <= 0:
        return total, 0
    if weight >= 100:
        return 0, total
    return math.ceil(total * (100 - weight) / 100), math.ceil(total * weight / 100)


# --------------------------------------------------------------------------- the state machine


@dataclass(frozen=True)
class Observation:
    desired_revision: str  # the spec's revision (contracts.revision)
    stable_revision: str | None  # the live stable Deployment's, None when it does not exist
    stable_ready: bool  # the stable Deployment is rolled out and ready at its template
    canary_ready: bool  # the canary Deployment runs the spec's revision, all replicas ready
    now: float  # seconds since the epoch
    counters: Mapping[str, Counters] | None = None  # per revision, cumulative; None: unknown
    action: str | None = None  # the rollout-action annotation


@dataclass(frozen=True)
class Decision:
    mode: Mode
    stable_replicas: int
    canary_replicas: int
    status: dict[str, Any]  # status.rollout
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)
    clear_action: bool = False
    verdict: Verdict | None = None
    rolled_back: tuple[str, str] | None = None  # (reason, message) while RolledBack


def rfc3339(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: Any) -> float | None:
    if not isinstance(text, str):
        return None
    try:
        return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _baseline(counters: Mapping[str, Counters] | None) -> dict[str, dict[str, float]] | None:
    if counters is None:
        return None
    return {revision: c.to_status() for revision, c in sorted(counters.items())}


def _window(
    counters: Mapping[str, Counters] | None, baseline: Any, revision: str
) -> Counters | None:
    if counters is None:
        return None
    if revision not in counters:
        return Counters()  # the gateway answers, but nothing of this revision yet
    before = Counters.from_status((baseline or {}).get(revision)) if baseline else None
    return counters[revision].minus(before)


def _stable_window(
    counters: Mapping[str, Counters] | None, baseline: Any, canary: str
) -> Counters | None:
    """Every revision but the canary's counts as stable (old pods of earlier revisions)."""
    if counters is None:
        return None
    total: Counters | None = None
    for revision in counters:
        if revision != canary:
            window = _window(counters, baseline, revision)
            if window is not None:
                total = window if total is None else total.plus(window)
    return total


def decide(
    spec: api.LLMDeploymentSpec, old: Mapping[str, Any] | None, seen: Observation
) -> Decision:
    """The next step of the rollout: mode, replicas, status.rollout and Events."""
    old = dict(old or {})
    total = spec.replicas
    rollout = spec.rollout
    desired = seen.desired_revision
    steps = rollout.steps
    clear = seen.action is not None

    def stable_status(events: list[tuple[str, str, str]]) -> Decision:
        status = {"revision": desired, "stableRevision": desired, "phase": "Stable",
                  "canaryWeight": 0}  # fmt: skip
        return Decision("rolling", total, 0, status, events, clear)

    # Promoting: the stable Deployment takes the revision; done when it is ready at it.
    if old.get("phase") == "Promoting" and old.get("canaryRevision") == desired:
        if seen.stable_revision == desired and seen.stable_ready:
            return stable_status(
                [("Normal", "Promoted", f"revision {desired} promoted: it is the only one now")]
            )
        weight = int(old.get("canaryWeight") or 100)
        _, canary = split(total, int(old.get("lastStepWeight") or weight))
        status = {**old, "revision": desired, "canaryWeight": 100}
        return Decision("promoting", total, canary, status, [], clear)

    if (
        rollout.strategy != "Canary"
        or seen.stable_revision is None
        or seen.stable_revision == desired
    ):
        return stable_status([])

    stable = seen.stable_revision
    fresh = old.get("canaryRevision") != desired or old.get("stableRevision") != stable
    events: list[tuple[str, str, str]] = []
    if fresh or old.get("phase") not in ("Progressing", "RolledBack"):
        old = {
            "revision": desired,
            "stableRevision": stable,
            "canaryRevision": desired,
            "phase": "Progressing",
            "step": 1,
            "steps": len(steps),
            "canaryWeight": steps[0].weight,
            "stepStartedAt": None,
            "baseline": None,
        }
        events.append(
            ("Normal", "CanaryStarted",
             f"revision {desired} starts as a canary beside stable {stable}: step 1/"
             f"{len(steps)} at {steps[0].weight}%")
        )  # fmt: skip

    def rolled_back(reason: str, message: str, verdict: Verdict | None = None) -> Decision:
        status = {**old, "phase": "RolledBack", "canaryWeight": 0, "message": message,
                  "rolledBackReason": reason}  # fmt: skip
        if verdict is not None:
            status["verdict"] = verdict.to_status(rfc3339(seen.now))
        events.append(("Warning", "RolledBack", f"revision {desired} rolled back: {message}"))
        return Decision("canary", total, 0, status, events, clear, verdict, (reason, message))

    def promoting(message: str) -> Decision:
        weight = int(old.get("canaryWeight") or 0) or steps[-1].weight
        status = {**old, "phase": "Promoting", "canaryWeight": 100, "lastStepWeight": weight,
                  "message": message}  # fmt: skip
        status.pop("rolledBackReason", None)
        events.append(("Normal", "Promoting", message))
        return Decision("promoting", total, split(total, weight)[1], status, events, clear)

    if seen.action == "promote":
        return promoting(f"revision {desired} promoted by hand ({_action_note()})")
    if old["phase"] == "RolledBack":
        reason = str(old.get("rolledBackReason") or "RolledBack")
        message = str(old.get("message") or "")
        return Decision("canary", total, 0, old, events, clear, None, (reason, message))
    if seen.action == "abort":
        return rolled_back(
            "Aborted",
            f"aborted by hand ({_action_note()}); stable {stable} serves everything; change "
            "the spec again to start a new revision, or `kubellm rollout promote`",
        )

    index = max(1, min(int(old.get("step") or 1), len(steps))) - 1
    step = steps[index]
    stable_replicas, canary_replicas = split(total, step.weight)
    old["canaryWeight"] = step.weight
    started = parse_time(old.get("stepStartedAt"))
    if started is None:
        if seen.canary_ready:  # the window opens once the canary serves at this step's size
            old["stepStartedAt"] = rfc3339(seen.now)
            old["baseline"] = _baseline(seen.counters)
            old["message"] = (
                f"step {index + 1}/{len(steps)}: canary at {step.weight}%, analysed over "
                f"{step.pause_seconds} s"
            )
            events.append(("Normal", "CanaryStep", old["message"]))
        else:
            old["message"] = (
                f"step {index + 1}/{len(steps)}: waiting for the canary's {canary_replicas} "
                "replica(s) to be ready"
            )
        return Decision("canary", stable_replicas, canary_replicas, old, events, clear)

    if old.get("baseline") is None and seen.counters is not None:
        old["baseline"] = _baseline(seen.counters)  # figures appeared mid-window: start here
    verdict = analyse(
        _window(seen.counters, old.get("baseline"), desired),
        _stable_window(seen.counters, old.get("baseline"), desired),
        rollout.analysis,
        spec.slo,
    )
    if verdict.result == "Fail":
        return rolled_back(verdict.reason, verdict.message, verdict)
    old["verdict"] = verdict.to_status(rfc3339(seen.now))
    if verdict.result == "Pass" and seen.now - started >= step.pause_seconds:
        if index + 1 >= len(steps):
            return promoting(
                f"revision {desired} passed all {len(steps)} steps: promoting ({verdict.message})"
            )
        nxt = steps[index + 1]
        old.update(step=index + 2, canaryWeight=nxt.weight, stepStartedAt=None, baseline=None)
        old["message"] = f"step {index + 2}/{len(steps)}: canary going to {nxt.weight}%"
        events.append(("Normal", "CanaryStep", f"step {index + 1} passed; {old['message']}"))
        stable_replicas, canary_replicas = split(total, nxt.weight)
    return Decision("canary", stable_replicas, canary_replicas, old, events, clear, verdict)


def _action_note() -> str:
    return f"annotation {ROLLOUT_ACTION_ANNOTATION}"
