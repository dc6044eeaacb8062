"""The figures of benchmarks/compare.py, their medians and ratios, and the markdown table; no engine runs here.

A figure is computed per timed sample, then the samples of every round are pooled: median [min-max]. A ratio says
how many times better pagedllm is than another engine: pagedllm/other for rates, other/pagedllm for times.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Figure:
    label: str
    higher_is_better: bool
    value: Callable[[dict, dict], float]  # (sample, workload) -> the figure


OUTPUT_TOK_S = Figure("output tok/s", True, lambda s, w: w["num_requests"] * w["max_tokens"] / s["wall_s"])
WALL_S = Figure("wall s", False, lambda s, w: s["wall_s"])
TTFT_MS = Figure("TTFT ms", False, lambda s, w: 1000 * s["ttft_s"])
DECODE_TOK_S = Figure("decode tok/s", True, lambda s, w: (w["max_tokens"] - 1) / (s["wall_s"] - s["ttft_s"]))
STARTUP_S = Figure("process start to first token s", False, lambda s, w: s["startup_s"])

FIGURES = {"W1": [OUTPUT_TOK_S], "W1-nopc": [OUTPUT_TOK_S], "W2": [DECODE_TOK_S, TTFT_MS], "W3": [WALL_S],
           "W3-nopc": [WALL_S], "W4": [DECODE_TOK_S, TTFT_MS], "W4-8": [OUTPUT_TOK_S], "startup": [STARTUP_S]}


def summarize(runs: list[dict], workloads: dict[str, dict], engines: list[str]) -> list[dict]:
    """One row per (workload, figure): each engine's median [min, max] and pagedllm's ratio to each other engine."""
    rows = []
    for name, workload in workloads.items():
        for figure in FIGURES[name]:
            stats = {}
            for engine in engines:
                values = [figure.value(s, workload) for run in runs
                          if run["engine"] == engine and run["workload"] == name for s in run["samples"]]
                if values:
                    stats[engine] = {"median": statistics.median(values), "min": min(values), "max": max(values),
                                     "n": len(values)}
            ratios = pagedllm_better_by({engine: s["median"] for engine, s in stats.items()},
                                        figure.higher_is_better)
            rows.append({"workload": name, "figure": figure.label, "higher_is_better": figure.higher_is_better,
                         "engines": stats, "pagedllm_better_by": ratios})
    return rows


def pagedllm_better_by(medians: dict[str, float], higher_is_better: bool) -> dict[str, float]:
    """How many times better pagedllm's median is than each other engine's (also for compare_serve.py)."""
    ours = medians.get("pagedllm")
    if ours is None:
        return {}
    return {engine: ours / value if higher_is_better else value / ours
            for engine, value in medians.items() if engine != "pagedllm"}


def _number(value: float) -> str:
    return f"{value:.1f}" if abs(value) >= 10 else f"{value:.2f}"


def markdown(rows: list[dict], engines: list[str]) -> str:
    others = [e for e in engines if e != "pagedllm"]
    head = ["workload", "figure"] + engines + [f"pagedllm vs {e} (>1: pagedllm better)" for e in others]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row["workload"], f"{row['figure']} ({'higher' if row['higher_is_better'] else 'lower'} is better)"]
        for engine in engines:
            s = row["engines"].get(engine)
            cells.append(f"{_number(s['median'])} [{_number(s['min'])}-{_number(s['max'])}]" if s else "n/a")
        cells += [f"{row['pagedllm_better_by'][e]:.2f}x" if e in row["pagedllm_better_by"] else "n/a" for e in others]
        lines.append("| " + " | ".join(cells) + " |")
    lines += prefix_caching_costs(rows)
    lines.append("")
    lines.append("Cells: median [min-max] over all timed runs of all rounds. Ratios: pagedllm/other for rates "
                 "(tok/s), other/pagedllm for times (s, ms); > 1 means pagedllm is better.")
    return "\n".join(lines)


def prefix_caching_costs(rows: list[dict]) -> list[str]:
    """W1 with prefix caching against W1 without (nothing in W1 hits the cache): what keeping it costs an engine."""
    on = next((r for r in rows if r["workload"] == "W1"), None)
    off = next((r for r in rows if r["workload"] == "W1-nopc"), None)
    if on is None or off is None:
        return []
    return ["", *(f"{engine}: prefix caching costs {100 * (1 - stats['median'] / off['engines'][engine]['median']):.1f}%"
                  " of W1 output tok/s (hit rate 0; negative: within the noise, faster with it)"
                  for engine, stats in on["engines"].items() if engine in off["engines"])]
