"""The comparison's report: one markdown table of every engine's figures side by side, with
"ours vs <peer>" ratios oriented so that > 1 always means ours is better, the runs of repeated
workloads, disturbed runs and errors under it, and the memory-bandwidth floor of batch-1 decode.
"""

from __future__ import annotations

from typing import Optional

from benchmarks import model_shapes as shapes
from benchmarks.compare_engines import ENGINE_TITLES, SHORT
from benchmarks.compare_workloads import Workload


NOISY_CORES = 0.15  # other processes' average CPU above which a run counts as disturbed
# (key in bench metrics, label, higher is better)
METRICS = [("output_throughput", "output tok/s", True), ("median_tpot_ms", "TPOT p50 (ms)", False),
           ("median_ttft_ms", "TTFT p50 (ms)", False)]


def _fmt(v: Optional[float]) -> str:
    if v is None:
        return "n/a"
    if abs(v) >= 100:
        return f"{v:.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}"


def _ratio(ours: Optional[float], peer: Optional[float], higher_better: bool, peer_short: str) -> str:
    if ours is None or peer is None or ours <= 0 or peer <= 0:
        return "n/a"
    if higher_better:
        return f"{ours / peer:.2f} (ours/{peer_short})"
    return f"{peer / ours:.2f} ({peer_short}/ours)"


def run_by_run(results: dict[str, dict], workloads: list[Workload], peers: list[str]) -> list[str]:
    """Under the table, for workloads run more than once: each engine's output tok/s run by run
    and ours/peer for the runs of the same index (taken in turn with ``--interleave``)."""
    lines = []
    for w in workloads:
        per = {e: [m["output_throughput"] for m in r["workloads"].get(w.name, {}).get("repeats", []) if m["completed"]]
               for e, r in results.items()}
        if max((len(v) for v in per.values()), default=0) < 2:
            continue
        text = "; ".join(f"{ENGINE_TITLES[e]} {', '.join(_fmt(v) for v in vals)}" for e, vals in per.items() if vals)
        for p in peers:
            pairs = [f"{o / v:.2f}" for o, v in zip(per.get("ours", []), per[p]) if v > 0]
            if pairs:
                text += f"; ours/{SHORT[p]} {', '.join(pairs)}"
        lines.append(f"- {w.title}, output tok/s run by run (the table has the medians): {text}")
    return ["", *lines] if lines else []


def markdown_table(results: dict[str, dict], workloads: list[Workload]) -> str:
    """The table (rows: workload x metric, then start-up and memory; columns: engines, then ratios)
    and the notes under it, from ``compare_run.run_all``'s results."""
    engines = list(results)
    peers = [e for e in engines if e != "ours"] if "ours" in engines else []
    head = ["workload", "metric"] + [ENGINE_TITLES[e] for e in engines] + [f"ours vs {SHORT[p]}" for p in peers]
    rows = [head, ["---"] * len(head)]

    def add(wl: str, label: str, vals: dict[str, Optional[float]], higher: bool, notes: dict[str, str]) -> None:
        row = [wl, label] + [_fmt(vals[e]) + notes.get(e, "") for e in engines]
        row += [_ratio(vals.get("ours"), vals[p], higher, SHORT[p]) for p in peers]
        rows.append(row)

    for w in workloads:
        notes = {}
        for e in engines:
            m = results[e]["workloads"].get(w.name)
            if m and m["failed"]:
                notes[e] = f" ({m['failed']} failed)"
        metrics = METRICS if w.output_len > 1 else METRICS[-1:]
        for key, label, higher in metrics:
            vals = {}
            for e in engines:
                m = results[e]["workloads"].get(w.name)
                vals[e] = m[key] if m and m["completed"] else None
            add(w.title, label, vals, higher, notes)
    for key, label, wl in (("startup_s", "start-up (s)", "server"), ("idle_rss_mb", "idle RSS (MB)", "server"),
                           ("peak_rss_mb", "peak RSS under load (MB)", "server")):
        add(wl, label, {e: results[e].get(key) for e in engines}, False, {})
    lines = ["| " + " | ".join(r) + " |" for r in rows]
    lines.append("")
    lines.append("Every ratio is oriented so that > 1 means ours is better (throughput: ours/peer; latency, "
                 "start-up and memory: peer/ours).")
    lines += run_by_run(results, workloads, peers)
    noisy = [f"{ENGINE_TITLES[e]} {w.title}: {m['other_cpu_cores']:.2f}"
             for e, r in results.items() for w in workloads
             if (m := r["workloads"].get(w.name)) and m.get("other_cpu_cores", 0) > NOISY_CORES]
    if noisy:
        lines += ["", f"Disturbed runs (other processes used more than {NOISY_CORES} cores on average meanwhile; "
                      "rerun on a quiet machine): " + "; ".join(noisy)]
    errs = [f"- {ENGINE_TITLES[e]}: {r['error'].splitlines()[0]}" for e, r in results.items() if r.get("error")]
    if errs:
        lines += ["", "Errors:"] + errs
    return "\n".join(lines)


def floor_report(floor: dict, results: dict[str, dict], workloads: list[Workload], gguf_type: str) -> list[str]:
    """The floor lines (see ``model_shapes.floor_lines``) with each engine's TPOT p50 in the first
    concurrency-1 workload next to it (none: the floor alone)."""
    c1 = next((w.name for w in workloads if w.concurrency == 1), None)
    tpot = {}
    for e, r in results.items():
        m = r["workloads"].get(c1)
        tpot[ENGINE_TITLES[e]] = m["median_tpot_ms"] if m and m["completed"] else None
    note = f" (float32 sum over {floor['bandwidth_mb']} MiB, {floor['bandwidth_threads']} threads)"
    return shapes.floor_lines(floor["bytes_gguf"], floor["bytes_bf16"], floor["bandwidth_bytes_s"], gguf_type,
                              tpot, note)

