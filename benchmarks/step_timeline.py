"""Summarizes an engine step trace (PAGEDLLM_STEP_TRACE=FILE, see pagedllm/engine/step_trace.py): where the engine's
wall time went, by step kind, and the gaps between steps.

    PAGEDLLM_STEP_TRACE=/tmp/steps.jsonl pagedllm serve ...      # then load it, e.g. pagedllm bench serve
    python benchmarks/step_timeline.py /tmp/steps.jsonl [--since T] [--until T]

Step kinds: `decode` (every request one token, plus its drafts), `mixed` (prompt chunks beside decodes) and
`prefill` (prompt chunks alone). Gaps longer than --idle-ms (default 50) count as idle (nothing to run, waiting for
requests) rather than as overhead between steps.
"""
from __future__ import annotations

import argparse
import json
import statistics


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def kind(step: dict) -> str:
    if step["prefill_reqs"] == 0:
        return "decode"
    return "prefill" if step["decode_reqs"] == 0 else "mixed"


def summarize(steps: list[dict], idle_ms: float) -> str:
    if not steps:
        return "no steps"
    span_ms = (steps[-1]["t"] - steps[0]["t"]) * 1e3 + sum(steps[-1][p] for p in ("schedule", "execute", "update"))
    gaps = [s["gap"] for s in steps[1:]]
    busy = {p: sum(s[p] for s in steps) for p in ("schedule", "execute", "update")}
    overhead_gaps = [g for g in gaps if g <= idle_ms]
    lines = [f"{len(steps)} steps over {span_ms / 1e3:.1f} s: execute {100 * busy['execute'] / span_ms:.1f}%, "
             f"schedule {100 * busy['schedule'] / span_ms:.1f}%, update {100 * busy['update'] / span_ms:.1f}%, "
             f"gaps <= {idle_ms:g} ms {100 * sum(overhead_gaps) / span_ms:.1f}% "
             f"(p50 {percentile(overhead_gaps, 0.5):.2f} ms, p99 {percentile(overhead_gaps, 0.99):.2f} ms), "
             f"idle {100 * sum(g for g in gaps if g > idle_ms) / span_ms:.1f}%",
             f"{'kind':8} {'steps':>6} {'time%':>6} {'exec p50':>9} {'exec p99':>9} {'step p99':>9} {'tokens':>7} "
             f"{'prefill tok':>11} {'reqs':>5}"]
    for name in ("decode", "mixed", "prefill"):
        group = [s for s in steps if kind(s) == name]
        if not group:
            continue
        execute = [s["execute"] for s in group]
        whole = [s["schedule"] + s["execute"] + s["update"] for s in group]
        lines.append(f"{name:8} {len(group):6d} {100 * sum(whole) / span_ms:6.1f} {percentile(execute, 0.5):9.1f} "
                     f"{percentile(execute, 0.99):9.1f} {percentile(whole, 0.99):9.1f} "
                     f"{statistics.mean(s['tokens'] for s in group):7.1f} "
                     f"{statistics.mean(s['prefill_tokens'] for s in group):11.1f} "
                     f"{statistics.mean(s['reqs'] for s in group):5.1f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace")
    parser.add_argument("--since", type=float, default=None, help="only steps starting at or after this time.time()")
    parser.add_argument("--until", type=float, default=None, help="only steps starting before this time.time()")
    parser.add_argument("--idle-ms", type=float, default=50.0)
    args = parser.parse_args()
    with open(args.trace) as f:
        steps = [json.loads(line) for line in f if line.strip()]
    steps = [s for s in steps if (args.since is None or s["t"] >= args.since)
             and (args.until is None or s["t"] < args.until)]
    print(summarize(steps, args.idle_ms))


if __name__ == "__main__":
    main()
