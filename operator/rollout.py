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
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any, Literal

from kubellm import api
from kubellm.contracts import ROLLOUT_ACTION_ANNOTATION
from kubellm.metrics import histogram_quantile

Mode = Literal["rolling", "canary", "promoting"]
Result = Literal["Pass", "Fail", "Inconclusive"]


# --------------------------------------------------------------------------- figures


@dataclass(frozen=True)
class Counters:
    """One revision's cumulative counters at the gateway (or their change over a window).

    `detail` holds the per-class figures the verdict is drawn from, flat (status keeps it
    as numbers): `class_requests|CLASS`, `clients`, `stream_ttft|CLASS|LE` and
    `tpot|CLASS|LE` (cumulative histogram buckets, LE `+Inf` last), and the mirror's
    `mirrored|CLASS`, `agreed|CLASS`, `tokens`, `tokens_agreed`, `divergence_sum`,
    `divergence_count`, `mirror_tpot|CLASS|LE`, `mirror_stable_tpot|CLASS|LE`."""

    requests: float = 0.0  # answered by a replica of the revision
    errors: float = 0.0  # of those, failed (5xx, stream errors)
    slo_met: float = 0.0  # of those, met slo.ttftSeconds and slo.itlSeconds
    ttft_sum: float = 0.0
    ttft_count: float = 0.0
    itl_sum: float = 0.0
    itl_count: float = 0.0
    detail: Mapping[str, float] = field(default_factory=dict)

    def _scalars(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in _SCALARS}

    def minus(self, earlier: Counters | None) -> Counters:
        """The change since `earlier`; a counter that went down (a gateway restart) counts
        from zero, as Prometheus' increase() does."""
        if earlier is None:
            return self

        def less(now: float, before: float) -> float:
            return now - before if now >= before else now

        values = {k: less(v, getattr(earlier, k)) for k, v in self._scalars().items()}
        detail = {k: less(v, earlier.detail.get(k, 0.0)) for k, v in self.detail.items()}
        return Counters(**values, detail=detail)

    def plus(self, other: Counters) -> Counters:
        detail = dict(self.detail)
        for key, value in other.detail.items():
            detail[key] = detail.get(key, 0.0) + value
        values = {k: v + getattr(other, k) for k, v in self._scalars().items()}
        return Counters(**values, detail=detail)

    def to_status(self) -> dict[str, float]:
        return {**{k: float(v) for k, v in self._scalars().items()}, **self.detail}

    @classmethod
    def from_status(cls, data: Mapping[str, Any] | None) -> Counters | None:
        if not isinstance(data, Mapping):
            return None
        numbers = {k: float(v) for k, v in data.items()
                   if isinstance(v, int | float) and math.isfinite(v)}  # fmt: skip
        known = {k: numbers.pop(k) for k in _SCALARS if k in numbers}
        return cls(**known, detail=numbers)

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

    # ------------------------------------------------------------ per-class figures

    def classes(self) -> list[str]:
        """The prompt-size classes with answers, in a fixed order."""
        return sorted({k.split("|")[1] for k in self.detail if k.startswith("class_requests|")})

    def class_requests(self, size: str) -> float:
        return self.detail.get(f"class_requests|{size}", 0.0)

    @property
    def clients(self) -> float:
        return self.detail.get("clients", 0.0)

    def histogram(self, metric: str, size: str) -> dict[float, float]:
        """Cumulative bucket counts {upper bound: count} of `metric` in class `size`."""
        prefix = f"{metric}|{size}|"
        return {float(k[len(prefix):]): v for k, v in self.detail.items()
                if k.startswith(prefix)}  # fmt: skip

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
        if self.detail:
            out["clients"] = int(self.clients)
            classes = {}
            for size in self.classes():
                row: dict[str, Any] = {"requests": int(self.class_requests(size))}
                for metric, key in (("stream_ttft", "ttftMedianSeconds"),
                                    ("tpot", "tpotMedianSeconds")):  # fmt: skip
                    median = histogram_quantile(0.5, self.histogram(metric, size).items())
                    if median is not None:
                        row[key] = round(median, 6)
                classes[size] = row
            out["classes"] = classes
        out.update(quality_figures(self))
        return out


_SCALARS = ("requests", "errors", "slo_met", "ttft_sum", "ttft_count", "itl_sum", "itl_count")


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


# --------------------------------------------------------------------------- statistics


def _counts(cumulative: Mapping[float, float], bounds: list[float]) -> list[float]:
    """Per-bucket counts over `bounds` (sorted) from cumulative counts (missing: carried)."""
    out, last, carried = [], 0.0, 0.0
    for bound in bounds:
        carried = cumulative.get(bound, carried)
        out.append(max(0.0, carried - last))
        last = max(last, carried)
    return out


def mann_whitney_z(canary: Mapping[float, float], stable: Mapping[float, float]) -> float:
    """The one-sided Mann-Whitney z of `canary` over `stable` (cumulative histograms with
    the same bounds): above 0 when the canary's values tend to be larger. Values in one
    bucket are ties (midranks, with the tie-corrected variance); 0 when either is empty."""
    bounds = sorted(set(canary) | set(stable))
    c, s = _counts(canary, bounds), _counts(stable, bounds)
    n1, n2 = sum(c), sum(s)
    total = n1 + n2
    if n1 <= 0 or n2 <= 0 or total < 2:
        return 0.0
    u, below = 0.0, 0.0
    for ci, si in zip(c, s, strict=True):
        u += ci * (below + si / 2)
        below += si
    ties = sum((ci + si) ** 3 - (ci + si) for ci, si in zip(c, s, strict=True))
    variance = n1 * n2 / 12 * ((total + 1) - ties / (total * (total - 1)))
    if variance <= 0:
        return 0.0
    return (u - n1 * n2 / 2) / math.sqrt(variance)


def critical_z(significance: float, comparisons: int) -> float:
    """The one-sided z a comparison must pass, Bonferroni-corrected over `comparisons`."""
    return NormalDist().inv_cdf(1 - significance / max(comparisons, 1))


def wilson_upper(successes: float, trials: float, significance: float) -> float:
    """The one-sided upper confidence bound on a share (Wilson score interval)."""
    if trials <= 0:
        return 1.0
    z = NormalDist().inv_cdf(1 - significance)
    share = successes / trials
    centre = share + z * z / (2 * trials)
    spread = z * math.sqrt(share * (1 - share) / trials + z * z / (4 * trials * trials))
    return min(1.0, (centre + spread) / (1 + z * z / trials))


def wilson_lower(successes: float, trials: float, significance: float) -> float:
    """The one-sided lower confidence bound on a share (Wilson score interval)."""
    return 1.0 - wilson_upper(trials - successes, trials, significance) if trials > 0 else 0.0


def excess_lower(
    canary: tuple[float, float], stable: tuple[float, float], significance: float
) -> float:
    """The one-sided lower confidence bound on p_canary - p_stable, each (count, trials):
    Newcombe's hybrid score interval (Wilson bounds of each share, recombined), sound with
    few trials and zero counts, where a difference of point shares is noise."""
    (cs, cn), (ss, sn) = canary, stable
    if cn <= 0 or sn <= 0:
        return -1.0
    pc, ps = cs / cn, ss / sn
    low, high = wilson_lower(cs, cn, significance), wilson_upper(ss, sn, significance)
    return pc - ps - math.sqrt((pc - low) ** 2 + (high - ps) ** 2)


def median_bounds(cumulative: Mapping[float, float], z: float) -> tuple[float, float] | None:
    """(lower, upper) distribution-free confidence bounds on the median of the values in a
    cumulative histogram: the values at ranks n/2 -+ z sqrt(n)/2 (the binomial order
    statistics' normal approximation), read off the histogram like its quantiles."""
    n = max(cumulative.values(), default=0.0)
    if n <= 0:
        return None
    spread = z * 0.5 / math.sqrt(n)
    items = cumulative.items()
    low = histogram_quantile(max(0.0, 0.5 - spread), items)
    high = histogram_quantile(min(1.0, 0.5 + spread), items)
    return None if low is None or high is None else (low, high)


def slower_lower(
    canary: Mapping[float, float], stable: Mapping[float, float], z: float
) -> tuple[float, float]:
    """One-sided lower confidence bounds on the canary's median over the stable one's, as
    (ratio, difference), combined from each median's bounds (MOVER, the method Newcombe's
    interval generalizes; the ratio on a log scale); (1, 0) when either is unknown."""
    mc, ms = histogram_quantile(0.5, canary.items()), histogram_quantile(0.5, stable.items())
    bc, bs = median_bounds(canary, z), median_bounds(stable, z)
    if mc is None or ms is None or bc is None or bs is None or min(mc, ms, bc[0]) <= 0:
        return 1.0, 0.0
    (lc, _), (_, us) = bc, bs
    difference = mc - ms - math.sqrt((mc - lc) ** 2 + (us - ms) ** 2)
    log_ratio = math.log(mc / ms) - math.sqrt(math.log(mc / lc) ** 2 + math.log(us / ms) ** 2)
    return math.exp(log_ratio), difference


# The latency check's ratio and floor are crossed with 95% confidence (one-sided): on
# lognormal latencies (sigma 0.6) a canary exactly at maxTTFTRatio fails 3% of the windows
# of 12-50 answers (the point ratio alone with the Mann-Whitney test: 15-50%), one 1.3x
# slower 0-1% (6-13%), one 3x slower 67-100% (89-100%).
BOUND_Z = NormalDist().inv_cdf(0.95)


@dataclass(frozen=True)
class Regression:
    size: str
    name: str  # TTFT or ITL
    canary: float  # medians
    stable: float
    z: float


def latency_regressions(
    canary: Counters, stable: Counters, analysis: api.RolloutAnalysis
) -> tuple[list[Regression], int]:
    """Streamed answers' TTFT and time per token compared class by class: a regression is
    a median over the allowed ratio and the absolute floor, each by its one-sided 95%
    lower confidence bound (`slower_lower`; a point ratio of two small samples' medians is
    noise), and a significant Mann-Whitney z (at the Bonferroni-corrected significance).
    Returns the regressions and how many comparisons were made."""
    checks = (
        ("TTFT", "stream_ttft", analysis.max_ttft_ratio, analysis.min_ttft_difference_seconds),
        ("ITL", "tpot", analysis.max_itl_ratio, analysis.min_itl_difference_seconds),
    )
    pairs = []
    for size in canary.classes():
        for name, metric, ratio, floor in checks:
            mine, theirs = canary.histogram(metric, size), stable.histogram(metric, size)
            if min(max(mine.values(), default=0), max(theirs.values(), default=0)) >= (
                analysis.min_class_requests
            ):
                pairs.append((size, name, mine, theirs, ratio, floor))
    limit = critical_z(analysis.significance, len(pairs))
    found = []
    for size, name, mine, theirs, ratio, floor in pairs:
        m, t = histogram_quantile(0.5, mine.items()), histogram_quantile(0.5, theirs.items())
        if m is None or t is None or m <= t * ratio or m - t <= floor:
            continue
        low_ratio, low_difference = slower_lower(mine, theirs, BOUND_Z)
        if low_ratio <= ratio or low_difference <= floor:
            continue
        z = mann_whitney_z(mine, theirs)
        if z > limit:
            found.append(Regression(size, name, m, t, z))
    return found, len(pairs)


def uncovered(
    seen: Mapping[str, float], stable: Counters, analysis: api.RolloutAnalysis
) -> list[str]:
    """The prompt-size classes the model serves (at least minClassShare of the stable
    answers) where the canary has `seen` fewer than minClassRequests requests."""
    total = sum(stable.class_requests(size) for size in stable.classes())
    return [
        size
        for size in stable.classes()
        if total
        and stable.class_requests(size) / total >= analysis.min_class_share
        and seen.get(size, 0.0) < analysis.min_class_requests
    ]


# --------------------------------------------------------------------------- answer quality


def quality_figures(counters: Counters) -> dict[str, Any]:
    """The mirror's figures of a revision (api.RevisionFigures' quality fields)."""
    d = counters.detail
    mirrored = sum(v for k, v in d.items() if k.startswith("mirrored|"))
    if not mirrored:
        return {}
    agreed = sum(v for k, v in d.items() if k.startswith("agreed|"))
    out: dict[str, Any] = {"mirrored": int(mirrored), "agreement": round(agreed / mirrored, 4)}
    if d.get("tokens"):
        out["tokenAgreement"] = round(d.get("tokens_agreed", 0.0) / d["tokens"], 4)
    if d.get("divergence_count"):
        out["divergence"] = round(d.get("divergence_sum", 0.0) / d["divergence_count"], 6)
    mine = _merged(counters, "mirror_tpot")
    theirs = _merged(counters, "mirror_stable_tpot")
    m, t = histogram_quantile(0.5, mine.items()), histogram_quantile(0.5, theirs.items())
    if m and t:
        out["speedup"] = round(t / m, 3)
    return out


def _merged(counters: Counters, metric: str) -> dict[float, float]:
    out: dict[float, float] = {}
    for key, value in counters.detail.items():
        parts = key.split("|")
        if parts[0] == metric and len(parts) == 3:
            bound = float(parts[2])
            out[bound] = out.get(bound, 0.0) + value
    return out


def quality_verdict(
    canary: Counters, stable: Counters | None, analysis: api.RolloutAnalysis, first_tokens: int
) -> Verdict | None:
    """The answer-quality gate on mirrored requests: None when it passes (or is not set),
    else an Inconclusive (too few mirrored requests, a class not mirrored) or a Fail."""
    quality = analysis.quality
    if quality is None:
        return None
    d = canary.detail
    mirrored = {k.split("|")[1]: v for k, v in d.items() if k.startswith("mirrored|")}
    total = sum(mirrored.values())
    if total < quality.min_mirrored_requests:
        return Verdict(
            "Inconclusive", "TooFewMirroredRequests",
            f"{total:.0f} of the {quality.min_mirrored_requests} mirrored requests the "
            "quality gate needs (spec.rollout.analysis.quality.minMirroredRequests; is "
            "spec.rollout.shadow set?)", canary, stable,
        )  # fmt: skip
    missing = uncovered(mirrored, stable or Counters(), analysis)
    if missing:
        return Verdict(
            "Inconclusive", "ClassNotMirrored",
            f"the mirror compared fewer than {analysis.min_class_requests} {', '.join(missing)} "
            "prompts; the quality gate waits until every class the model serves is seen",
            canary, stable,
        )  # fmt: skip
    agreed = sum(v for key, v in d.items() if key.startswith("agreed|"))
    bound = wilson_upper(agreed, total, analysis.significance)
    if bound < quality.min_agreement:
        worst = min(mirrored, key=lambda size: d.get(f"agreed|{size}", 0.0) / mirrored[size])
        differ = 1 - d.get(f"agreed|{worst}", 0.0) / mirrored[worst]
        return Verdict(
            "Fail", "CanaryAnswersDiffer",
            f"agreement {agreed / total:.0%} < {quality.min_agreement:.0%} on {total:.0f} "
            f"mirrored requests (upper bound {bound:.0%}); greedy answers differ within the "
            f"first {first_tokens} tokens in {differ:.0%} of {worst} prompts "
            "(spec.rollout.analysis.quality.minAgreement); check the revision's "
            "quantization, dtype or checkpoint", canary, stable,
        )  # fmt: skip
    tokens = d.get("tokens", 0.0)
    if tokens and wilson_upper(d.get("tokens_agreed", 0.0), tokens, analysis.significance) < (
        quality.min_token_agreement
    ):
        return Verdict(
            "Fail", "CanaryTokensDiffer",
            f"per-token agreement {d.get('tokens_agreed', 0.0) / tokens:.0%} < "
            f"{quality.min_token_agreement:.0%} over {tokens:.0f} tokens of {total:.0f} "
            "mirrored requests (spec.rollout.analysis.quality.minTokenAgreement)",
            canary, stable,
        )  # fmt: skip
    count = d.get("divergence_count", 0.0)
    if count and d.get("divergence_sum", 0.0) / count > quality.max_divergence:
        return Verdict(
            "Fail", "CanaryDiverges",
            f"mean divergence {d['divergence_sum'] / count:.3f} nats/token > "
            f"{quality.max_divergence:g} over {count:.0f} tokens of {total:.0f} mirrored "
            "requests (spec.rollout.analysis.quality.maxDivergence)", canary, stable,
        )  # fmt: skip
    return None


# --------------------------------------------------------------------------- the verdict


def analyse(
    canary: Counters | None,
    stable: Counters | None,
    analysis: api.RolloutAnalysis,
    slo: api.SLO,
    first_tokens: int = api.RolloutShadow().first_tokens,
) -> Verdict:
    """The canary's verdict over one window (figures in, verdict out); `first_tokens`:
    the mirror's k (spec.rollout.shadow.firstTokens), for the quality gate's message.

    Inconclusive until the canary answered `minRequests`. Then Fail on a significantly
    higher error rate. Inconclusive until it answered `minClients` distinct clients and
    `minClassRequests` in every prompt-size class the model serves. Then Fail on a latency
    regression (streamed answers, class by class, medians over the ratio and the floor
    and a significant Mann-Whitney test), on the burn rate, or on the quality gate; else
    Pass."""
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
    stable = stable if stable is not None else Counters()
    stable_errors = stable.error_rate
    # a canary error rate over the allowance, and not plausibly stable's (a few errors of a
    # small window are no evidence): the rate's lower confidence bound is over it too
    lower = 1 - wilson_upper(canary.requests - canary.errors, canary.requests,
                             analysis.significance)  # fmt: skip
    allowed = stable_errors + analysis.max_error_rate
    if canary.error_rate > allowed and lower > stable_errors:
        return Verdict(
            "Fail",
            "CanaryErrorRate",
            f"the canary failed {canary.error_rate:.1%} of {canary.requests:.0f} requests, "
            f"stable {stable_errors:.1%} (allowed: {analysis.max_error_rate:.1%} more, "
            "spec.rollout.analysis.maxErrorRate); see the canary pods' logs",
            canary,
            stable,
        )
    if stable.requests < analysis.min_requests:
        return Verdict(
            "Inconclusive", "TooFewStableRequests",
            f"the stable revision answered {stable.requests:.0f} requests in the window, "
            f"fewer than the {analysis.min_requests} a comparison needs", canary, stable,
        )  # fmt: skip
    if not canary.detail:
        return Verdict(
            "Inconclusive", "NoClassFigures",
            "the gateway sends no per-class figures (kubellm_gateway_revision_clients_total): "
            "upgrade it, or `kubellm rollout promote`", canary, stable,
        )  # fmt: skip
    if canary.clients < analysis.min_clients:
        return Verdict(
            "Inconclusive", "TooFewClients",
            f"the canary answered {canary.clients:.0f} distinct clients of the "
            f"{analysis.min_clients} a verdict needs (spec.rollout.analysis.minClients)",
            canary, stable,
        )  # fmt: skip
    missing = uncovered({c: canary.class_requests(c) for c in canary.classes()}, stable, analysis)
    if missing:
        return Verdict(
            "Inconclusive", "ClassNotCovered",
            f"the canary answered fewer than {analysis.min_class_requests} {', '.join(missing)} "
            f"prompts, a class the model serves (spec.rollout.analysis.minClassRequests, "
            "minClassShare); the step waits until it has", canary, stable,
        )  # fmt: skip
    found, compared = latency_regressions(canary, stable, analysis)
    if found:
        worst = max(found, key=lambda r: r.canary / r.stable)
        ttft = worst.name == "TTFT"
        knob = "maxTTFTRatio" if ttft else "maxITLRatio"
        limit = analysis.max_ttft_ratio if ttft else analysis.max_itl_ratio
        return Verdict(
            "Fail",
            f"Canary{worst.name}Regression",
            f"the canary's median {worst.name} on streamed {worst.size} prompts is "
            f"{worst.canary / worst.stable:.2f}x the stable revision's ({_ms(worst.canary)} "
            f"vs {_ms(worst.stable)}, Mann-Whitney z {worst.z:.1f}; allowed {limit:g}x, "
            f"spec.rollout.analysis.{knob}); check the new revision's engine settings "
            "(quantization, kvCacheDtype, image)",
            canary,
            stable,
        )
    burn = canary.burn_rate(slo.objective)
    stable_burn = stable.burn_rate(slo.objective)
    budget = 1.0 - slo.objective
    missed = (max(0.0, canary.requests - canary.slo_met), canary.requests)
    stable_missed = (max(0.0, stable.requests - stable.slo_met), stable.requests)
    # the burn over stable's is a difference of two shares: over the allowance only when
    # its lower confidence bound is (one or two misses more of 50 are no evidence)
    excess = excess_lower(missed, stable_missed, analysis.significance)
    if burn - stable_burn > analysis.max_burn_rate and excess > analysis.max_burn_rate * budget:
        return Verdict(
            "Fail",
            "CanarySLOBurn",
            f"the canary burns its SLO error budget at {burn:.1f}x (stable {stable_burn:.1f}x, "
            f"allowed {analysis.max_burn_rate:g} more, spec.rollout.analysis.maxBurnRate; "
            f"at least {excess / budget:.1f}x more at significance {analysis.significance:g}): "
            f"{missed[0]:.0f} of {canary.requests:.0f} requests missed "
            f"ttft {slo.ttft_seconds:g} s or itl {slo.itl_seconds:g} s",
            canary,
            stable,
        )
    gate = quality_verdict(canary, stable, analysis, first_tokens)
    if gate is not None:
        return gate
    return Verdict(
        "Pass",
        "AnalysisPassed",
        f"over {canary.requests:.0f} requests from {canary.clients:.0f} clients: errors "
        f"{canary.error_rate:.1%} (stable {stable_errors:.1%}), {compared} latency "
        f"comparisons by class with no significant regression, burn {burn:.1f}x",
        canary,
        stable,
    )


def shadow_verdict(
    canary: Counters | None,
    stable: Counters | None,
    analysis: api.RolloutAnalysis,
    first_tokens: int = api.RolloutShadow().first_tokens,
) -> Verdict:
    """The shadow step's verdict (a step of weight 0): the canary answers no client, so the
    quality gate on its mirrored answers alone decides (Inconclusive without figures)."""
    if canary is None:
        return analyse(None, stable, analysis, api.SLO())
    if analysis.quality is None:  # the spec's rules require it; an old object may lack it
        return Verdict("Inconclusive", "NoQualityGate", "a shadow step (weight 0) needs "
                       "spec.rollout.analysis.quality", canary, stable)  # fmt: skip
    gate = quality_verdict(canary, stable, analysis, first_tokens)
    if gate is not None:
        return gate
    figures = quality_figures(canary)
    return Verdict(
        "Pass",
        "AnalysisPassed",
        f"over {figures['mirrored']} mirrored requests: agreement {figures['agreement']:.0%}"
        " within spec.rollout.analysis.quality",
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


def step_split(total: int, weight: int) -> tuple[int, int]:
    """`split` for a running step: a shadow step (weight 0) runs one canary replica beside
    the whole stable fleet, for the mirrored requests."""
    return (total, 1) if weight == 0 and total > 0 else split(total, weight)


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
    # The gateways mirror while the step runs: in every step of a rollout without a shadow
    # step; with one, in it only. After it passed, the answers were judged, and mirrors in a
    # real-traffic step would load the canary's replicas alone, biasing its latency checks.
    mirrors = rollout.shadow is not None and (step.weight == 0 or all(s.weight > 0 for s in steps))
    if mirrors:
        assert rollout.shadow is not None
        old["shadow"] = rollout.shadow.model_dump(by_alias=True)
    else:
        old.pop("shadow", None)
    stable_replicas, canary_replicas = step_split(total, step.weight)
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
    analysis = rollout.analysis
    if rollout.shadow is not None and not mirrors:  # judged in the shadow step
        analysis = analysis.model_copy(update={"quality": None})
    window = (
        _window(seen.counters, old.get("baseline"), desired),
        _stable_window(seen.counters, old.get("baseline"), desired),
        analysis,
    )
    k = (rollout.shadow or api.RolloutShadow()).first_tokens
    verdict = shadow_verdict(*window, k) if step.weight == 0 else analyse(*window, spec.slo, k)
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
        if not _mirrors(rollout, nxt):
            old.pop("shadow", None)
        old["message"] = f"step {index + 2}/{len(steps)}: canary going to {nxt.weight}%"
        events.append(("Normal", "CanaryStep", f"step {index + 1} passed; {old['message']}"))
        stable_replicas, canary_replicas = step_split(total, nxt.weight)
    return Decision("canary", stable_replicas, canary_replicas, old, events, clear, verdict)


def _mirrors(rollout: api.Rollout, step: api.CanaryStep) -> bool:
    """Whether the gateways mirror during `step`: every step of a rollout with a mirror and
    no shadow step; with a shadow step, that step only."""
    if rollout.shadow is None:
        return False
    return step.weight == 0 or all(s.weight > 0 for s in rollout.steps)


def _action_note() -> str:
    return f"annotation {ROLLOUT_ACTION_ANNOTATION}"
