"""The report of `turnstile bench`: derived ratios and the terminal table."""

from __future__ import annotations

from typing import Any, Final


def _median(sc: dict[str, Any] | None, target: str, metric: str) -> float | None:
    if sc is None or target not in sc["targets"]:
        return None
    s = sc["targets"][target]["summary"].get(metric)
    return None if s is None else float(s["median"])


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _diff(a: float | None, b: float | None) -> float | None:
    return a - b if a is not None and b is not None else None


def derived(results: list[dict[str, Any]], servers: list[str] | None = None) -> dict[str, Any]:
    """Ratios and differences of medians; with `servers` (`turnstile bench --servers`),
    each other server's Turnstile against uvicorn's, scenario by scenario."""
    by_name = {r["name"]: r for r in results}
    out: dict[str, Any] = {"cpu_ratio_turnstile_over_nginx": {}}
    for r in results:
        metric = "cpu_us_per_event" if r["stream"] else "cpu_us_per_req"
        out["cpu_ratio_turnstile_over_nginx"][r["name"]] = _ratio(
            _median(r, "turnstile", metric), _median(r, "nginx", metric)
        )
    ns1, s1 = by_name.get("nonstream-c1"), by_name.get("stream-c1")
    paced = next((r for r in results if r["paced"]), None)
    for proxy in ("nginx", "turnstile"):
        out[f"added_p50_ms_c1_{proxy}"] = _diff(
            _median(ns1, proxy, "latency_p50_ms"), _median(ns1, "direct", "latency_p50_ms")
        )
        out[f"added_ttfb_p50_ms_c1_stream_{proxy}"] = _diff(
            _median(s1, proxy, "ttfb_p50_ms"), _median(s1, "direct", "ttfb_p50_ms")
        )
        out[f"paced_throughput_{proxy}_over_direct"] = _ratio(
            _median(paced, proxy, "events_per_s"), _median(paced, "direct", "events_per_s")
        )
        out[f"paced_p99_stream_time_{proxy}_over_direct"] = _ratio(
            _median(paced, proxy, "latency_p99_ms"), _median(paced, "direct", "latency_p99_ms")
        )
    for r in results:  # CPU per request against prompt length (the c=1 scenarios)
        n = r.get("prompt_tokens")
        if r["concurrency"] != 1 or r["paced"]:
            continue
        kind = "stream" if r["stream"] else "nonstream"
        length = "default" if n is None else str(n)
        for proxy in ("nginx", "turnstile"):
            out.setdefault(f"cpu_us_per_req_c1_{kind}_{proxy}_by_prompt_tokens", {})[length] = (
                _median(r, proxy, "cpu_us_per_req")
            )
        out.setdefault(f"added_p50_ms_c1_{kind}_turnstile_by_prompt_tokens", {})[length] = _diff(
            _median(r, "turnstile", "latency_p50_ms"), _median(r, "direct", "latency_p50_ms")
        )
    for server in servers or []:
        if server != "uvicorn":
            _server_ratios(out, results, f"turnstile-{server}", ns1, s1)
    for r in results:
        if r["paced"] or r["concurrency"] == 1:
            continue
        out.setdefault("throughput_2_workers_over_1", {})[r["name"]] = _ratio(
            _median(r, "turnstile-2w", "req_per_s"), _median(r, "turnstile", "req_per_s")
        )
    return out


def _server_ratios(
    out: dict[str, Any],
    results: list[dict[str, Any]],
    target: str,
    ns1: dict[str, Any] | None,
    s1: dict[str, Any] | None,
) -> None:
    """`target` (Turnstile under another server) against `turnstile` (under uvicorn)."""
    for r in results:
        if target not in r["targets"]:
            continue
        cpu = "cpu_us_per_event" if r["stream"] else "cpu_us_per_req"
        out.setdefault(f"cpu_ratio_{target}_over_turnstile", {})[r["name"]] = _ratio(
            _median(r, target, cpu), _median(r, "turnstile", cpu)
        )
        rate = "events_per_s" if r["paced"] else "req_per_s"
        out.setdefault(f"throughput_ratio_{target}_over_turnstile", {})[r["name"]] = _ratio(
            _median(r, target, rate), _median(r, "turnstile", rate)
        )
        out.setdefault(f"cpu_ratio_{target}_over_nginx", {})[r["name"]] = _ratio(
            _median(r, target, cpu), _median(r, "nginx", cpu)
        )
    out[f"added_p50_ms_c1_{target}"] = _diff(
        _median(ns1, target, "latency_p50_ms"), _median(ns1, "direct", "latency_p50_ms")
    )
    out[f"added_ttfb_p50_ms_c1_stream_{target}"] = _diff(
        _median(s1, target, "ttfb_p50_ms"), _median(s1, "direct", "ttfb_p50_ms")
    )


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    if abs(x) >= 100:
        return f"{x:.0f}"
    return f"{x:.3g}" if abs(x) >= 1 else f"{x:.2g}"


def _cell(s: dict[str, float] | None) -> str:
    if s is None:
        return "-"
    return f"{_fmt(s['median'])} ({_fmt(s['min'])}-{_fmt(s['max'])})"


COLUMNS: Final[tuple[tuple[str, str], ...]] = (
    ("req/s", "req_per_s"),
    ("p50 ms", "latency_p50_ms"),
    ("p99 ms", "latency_p99_ms"),
    ("TTFB p50 ms", "ttfb_p50_ms"),
    ("CPU us/req", "cpu_us_per_req"),
    ("CPU us/event", "cpu_us_per_event"),
    ("rec us/turn", "recording_us_per_turn"),
    ("errors", "errors"),
)


def format_report(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [
        f"machine: {m['cpu_model']}, {m['cpu_count']} CPUs ({m['cpus_allowed']} allowed), "
        f"loadavg before: {m['loadavg_before']}",
        "cells: median (min-max) over rounds; CPU is the proxy's own",
    ]
    for why in report["skipped"].values():
        lines.append(f"skipped: {why}")
    for sc in report["scenarios"]:
        pin = f", pinned to CPU {sc['pinned_cpu']}" if sc["pinned_cpu"] is not None else ""
        lines.append(f"\n{sc['name']} (concurrency {sc['concurrency']}{pin})")
        rows = [["target", *(c for c, _ in COLUMNS)]]
        for target, t in sc["targets"].items():
            rows.append([target, *(_cell(t["summary"][k]) for _, k in COLUMNS)])
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines += [
            "  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows
        ]
        if sc.get("recording_us_per_turn_total") is not None:
            lines.append(
                f"  turnstile recording threads, whole scenario: "
                f"{_fmt(sc['recording_us_per_turn_total'])} us/turn"
            )
    soak = report.get("soak")
    if soak:
        lines.append(
            f"\nsoak: {soak['streams']} streams x {soak['tokens_per_s']:g} tokens/s for "
            f"{soak['duration_s']:g} s, {soak['requests']} streams, {soak['errors']} errors; "
            f"Turnstile RSS {_fmt(soak['rss_start_mb'])} MiB at start, "
            f"{_fmt(soak['rss_max_mb'])} max, {_fmt(soak['rss_end_mb'])} at the end; second "
            f"half {_fmt(soak['rss_second_half_range_mb'][0])}-"
            f"{_fmt(soak['rss_second_half_range_mb'][1])} MiB"
        )
    writer = report.get("writer_by_prompt_tokens")
    if writer:
        lines.append("\nwriter cost per turn, in-process CPU time (turnstile.bench.writer):")
        for n, w in writer.items():
            lines.append(
                f"  {n} prompt + {w['completion_tokens']} completion tokens: journal frame "
                f"{_fmt(w['journal_encode_us_per_turn'])} us, Parquet row "
                f"{_fmt(w['shard_write_us_per_row'])} us"
            )
    lines.append("\nderived (from medians):")
    for key, value in report["derived"].items():
        if isinstance(value, dict):
            for name, v in value.items():
                lines.append(f"  {key}[{name}]: {_fmt(v)}")
        else:
            lines.append(f"  {key}: {_fmt(value)}")
    return "\n".join(lines)
