"""The report of bench/gateway/proxy.py: the table, the verdicts against the gateway's own
targets and issue 28's ratios (each within one run), GC pauses."""

from __future__ import annotations

from typing import Any


def gc_summary(log: list[list[float]], seconds: float) -> dict[str, dict[str, float]]:
    """Per generation: collections per second, mean and max pause (ms), share of the time."""
    out = {}
    for gen in (0, 1, 2):
        pauses = [1000 * e[1] for e in log if e[2] == gen]
        out[f"gen{gen}"] = {
            "per_s": len(pauses) / seconds,
            "mean_ms": sum(pauses) / len(pauses) if pauses else 0.0,
            "max_ms": max(pauses, default=0.0),
            "busy": sum(pauses) / 1000 / seconds,
        }
    return out


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'phase':13} {'path':16} {'conc':>4} {'req/s':>7} {'p50 ms':>7} {'p99 ms':>7} "
        f"{'ttft p50':>8} {'ttft p99':>8} {'gap p99':>7} {'burst':>5} {'err':>4} "
        f"{'CPU ms/req':>13} "
        f"{'core':>7}"
    )
    for r in rows:
        gw = r["gateway_cpu_ms_per_request"]
        busy = r["gateway_core_busy"]
        print(
            f"{r['phase']:13} {r['path']:16} {r['in_flight']:>4.0f} {r['rps']:>7.0f} "
            f"{r['p50_ms']:>7.2f} {r['p99_ms']:>7.2f} {r['ttft_p50_ms']:>8.2f} "
            f"{r['ttft_p99_ms']:>8.2f} {r['gap_p99_ms']:>7.2f} {r['burst']:>5} {r['errors']:>4} "
            f"{'' if gw is None else f'{gw:.3f}':>13} {'' if busy is None else f'{busy:.0%}':>7}"
        )
    for r in rows:
        split = r.get("cpu_ms_per_request_by_process")
        if split:
            parts = ", ".join(f"{name} {ms:.3f}" for name, ms in split.items())
            print(f"{r['phase']} {r['path']}: CPU ms per request by process: {parts}")
    for r in rows:
        if r.get("gc"):
            print(
                f"gateway GC pauses, {r['phase']}: "
                + "; ".join(
                    f"{gen} {g['per_s']:.1f}/s mean {g['mean_ms']:.2f} ms max {g['max_ms']:.2f} "
                    f"ms ({g['busy']:.1%} of the time)"
                    for gen, g in r["gc"].items()
                )
            )


def verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    by = {(r["phase"], r["path"]): r for r in rows}
    out: dict[str, Any] = {}
    if ("json-max", "gateway") in by:
        jd, jg = by["json-max", "direct"], by["json-max", "gateway"]
        out["json_gateway_rps"] = jg["rps"]
        out["json_rps_ratio_to_direct"] = jg["rps"] / jd["rps"]
        out["target_rps_met"] = jg["rps"] >= 3000
    if ("stream", "gateway") in by:
        sd, sg = by["stream", "direct"], by["stream", "gateway"]
        out["stream_added_ttft_p99_ms"] = sg["ttft_p99_ms"] - sd["ttft_p99_ms"]
        out["stream_added_e2e_p99_ms"] = sg["p99_ms"] - sd["p99_ms"]
        out["stream_added_gap_p99_ms"] = sg["gap_p99_ms"] - sd["gap_p99_ms"]
        worst = max(out["stream_added_ttft_p99_ms"], out["stream_added_e2e_p99_ms"])
        out["target_p99_met"] = worst <= 2
    if ("stream-closed", "gateway") in by:
        sd, sg = by["stream-closed", "direct"], by["stream-closed", "gateway"]
        out["closed_added_ttft_p99_ms"] = sg["ttft_p99_ms"] - sd["ttft_p99_ms"]
        out["closed_added_e2e_p99_ms"] = sg["p99_ms"] - sd["p99_ms"]
        out["closed_burst"] = sg["burst"]
    if ("stream", "tcp-relay") in by:
        sd, sr = by["stream", "direct"], by["stream", "tcp-relay"]
        out["relay_added_ttft_p99_ms"] = sr["ttft_p99_ms"] - sd["ttft_p99_ms"]
        out["relay_added_e2e_p99_ms"] = sr["p99_ms"] - sd["p99_ms"]
        out["relay_added_gap_p99_ms"] = sr["gap_p99_ms"] - sd["gap_p99_ms"]
    out["issue28"] = issue28_ratios(by)
    return out


def _cpu(row: dict[str, Any] | None) -> float | None:
    return None if row is None else row["gateway_cpu_ms_per_request"]


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def issue28_ratios(by: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
    """Issue 28's targets as ratios within this run, for this checkout and (with
    --baseline-python) the landed one. Rates on a shared core vary with what else runs, so
    beside req/s each is also given per core: 1 / CPU per request."""
    out: dict[str, Any] = {}
    for suffix in ("", "@landed"):
        json_gw, json_epp = (
            by.get(("json-max", "gateway" + suffix)),
            by.get(("json-max", "envoy+epp" + suffix)),
        )
        stream_gw, stream_epp = (
            by.get(("stream", "gateway" + suffix)),
            by.get(("stream", "envoy+epp" + suffix)),
        )
        json_envoy = by.get(("json-max", "envoy"))
        figures = {
            # Envoy + picker >= 0.5 x the gateway's non-streamed req/s
            "epp_over_gateway_rps": _ratio(
                json_epp and json_epp["rps"], json_gw and json_gw["rps"]
            ),
            "epp_over_gateway_rps_per_core": _ratio(_cpu(json_gw), _cpu(json_epp)),
            # Envoy + picker CPU per stream <= 1.5 x the gateway's
            "epp_over_gateway_cpu_per_stream": _ratio(_cpu(stream_epp), _cpu(stream_gw)),
            # the gateway >= 0.25 x Envoy's req/s, <= 4 x its CPU per request
            "gateway_over_envoy_rps": _ratio(
                json_gw and json_gw["rps"], json_envoy and json_envoy["rps"]
            ),
            "gateway_over_envoy_cpu": _ratio(_cpu(json_gw), _cpu(json_envoy)),
        }
        if any(v is not None for v in figures.values()):
            out["this" if not suffix else "landed"] = figures
    if "this" in out and "landed" in out:
        out["this_over_landed_cpu"] = {
            f"{phase} {path}": _ratio(
                _cpu(by.get((phase, path))), _cpu(by.get((phase, path + "@landed")))
            )
            for phase in ("json-max", "stream")
            for path in ("gateway", "envoy+epp")
        }
    return out


TARGETS = {
    "epp_over_gateway_rps": (">=", 0.5),
    "epp_over_gateway_rps_per_core": (">=", 0.5),
    "epp_over_gateway_cpu_per_stream": ("<=", 1.5),
    "gateway_over_envoy_rps": (">=", 0.25),
    "gateway_over_envoy_cpu": ("<=", 4.0),
}


def print_verdict(v: dict[str, Any]) -> None:
    if "json_gateway_rps" in v:
        print(
            f"json-max through the gateway: {v['json_gateway_rps']:.0f} req/s "
            f"({v['json_rps_ratio_to_direct']:.0%} of direct); target >= 3000: "
            f"{'met' if v['target_rps_met'] else 'MISSED'}"
        )
    if "stream_added_ttft_p99_ms" in v:
        print(
            f"stream, p99 added by the gateway: first chunk "
            f"{v['stream_added_ttft_p99_ms']:+.2f} ms, whole stream "
            f"{v['stream_added_e2e_p99_ms']:+.2f} ms, chunk gap "
            f"{v['stream_added_gap_p99_ms']:+.2f} ms; target <= 2 ms: "
            f"{'met' if v['target_p99_met'] else 'MISSED'}"
        )
    if "closed_added_ttft_p99_ms" in v:
        print(
            f"stream-closed (closed loop, up to {v['closed_burst']} requests started within "
            f"1 ms), p99 added: first chunk {v['closed_added_ttft_p99_ms']:+.2f} ms, whole "
            f"stream {v['closed_added_e2e_p99_ms']:+.2f} ms; for reference: bursts of "
            "simultaneous arrivals, not independent clients"
        )
    if "relay_added_ttft_p99_ms" in v:
        print(
            f"stream, p99 added by a bare TCP relay (the floor): first chunk "
            f"{v['relay_added_ttft_p99_ms']:+.2f} ms, whole stream "
            f"{v['relay_added_e2e_p99_ms']:+.2f} ms, chunk gap "
            f"{v['relay_added_gap_p99_ms']:+.2f} ms"
        )
    ratios = v.get("issue28", {})
    for which, figures in ratios.items():
        if which == "this_over_landed_cpu":
            print("CPU per request, this checkout / landed: " + ", ".join(
                f"{k} {x:.2f}" for k, x in figures.items() if x is not None
            ))  # fmt: skip
            continue
        parts = []
        for key, value in figures.items():
            if value is None:
                continue
            op, target = TARGETS[key]
            met = value >= target if op == ">=" else value <= target
            parts.append(f"{key} {value:.2f} ({op} {target:g}: {'met' if met else 'MISSED'})")
        print(f"issue 28 ratios ({which}): " + "; ".join(parts))
