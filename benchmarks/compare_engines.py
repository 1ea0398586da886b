"""The engines the comparison runs and how each one is started: ours (``python -m service``),
llama.cpp's llama-server and vLLM-CPU (the peers from /work/shared/peers, see its README).

Each starter takes the comparison's arguments and a port and returns a
:class:`benchmarks.harness.ServerProcess` that is still starting; ``compare_run`` waits for it.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from typing import Optional

from benchmarks import harness
from benchmarks.bench_serve_prompts import default_gguf_path
from benchmarks.harness import ServerProcess

PEERS_SHARED = "/work/shared/peers"
SERVED_NAME = "smollm2"  # the bundled model's served name; a --model directory serves under its own name
ENGINE_TITLES = {"ours": "ours", "vllm": "vLLM-CPU", "llama": "llama.cpp"}
SHORT = {"vllm": "vLLM", "llama": "llama"}


def log_path(a: argparse.Namespace, engine: str, port: int) -> str:
    return os.path.join(a.log_dir, f"{engine}-{port}.log")


def start_ours(a: argparse.Namespace, port: int) -> ServerProcess:
    """``python -m service`` serving ``a.ours_model`` (the GGUF llama-server runs, or with
    ``--gguf-type hf`` the HF directory vLLM-CPU runs) under ``a.served_name``, or ``--ours-cmd``
    with its fields filled in; the caller's environment passes unchanged."""
    if a.ours_cmd:
        cmd = shlex.split(a.ours_cmd.format(python=a.python, port=port, model=a.served_name, gguf=a.gguf))
    else:
        args = ["--served-model-name", a.served_name]
        if a.ours_model != default_gguf_path():
            args += ["--model", a.ours_model]
        cmd = harness.service_command(port, args, a.python)
    cmd += shlex.split(a.ours_args)
    return harness.launch("ours", cmd, port, log_path(a, "ours", port), cwd=harness.REPO)


def llama_binary(a: argparse.Namespace) -> str:
    return os.path.join(a.llama_dir, "build", "bin", "llama-server")


def start_llama(a: argparse.Namespace, port: int) -> ServerProcess:
    """llama-server on ``a.gguf`` with 32 slots of 2,048 tokens and 2 threads."""
    from engine import platform

    # ggml's AMX matmul (which repacking selects on CPUs with AMX) crashes llama-server at start-up on
    # the KVM Xeon hosts (HISTORY.md); --no-repack keeps the plain CPU kernels, `--llama-args --repack`
    # turns it back on.
    no_repack = ["--no-repack"] if platform.has("amx_tile") else []
    cmd = [llama_binary(a), "-m", a.gguf, "--host", "127.0.0.1", "--port", str(port), "--alias", a.served_name,
           "--parallel", "32", "-c", "65536", "-t", "2", "-tb", "2", "--cont-batching", *no_repack,
           *shlex.split(a.llama_args)]
    return harness.launch("llama", cmd, port, log_path(a, "llama", port))


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


def start_vllm(a: argparse.Namespace, port: int) -> ServerProcess:
    """vLLM-CPU through the shared peers' start script, which starts it as a session leader and
    prints its pid."""
    model_dir = vllm_model_dir(a)  # before launch: conversion is not start-up time
    script = os.path.join(a.peers_shared, "start_vllm_cpu.sh")
    # The script names the model smollm2; a later --served-model-name wins (argparse keeps the last).
    name = [] if a.served_name == SERVED_NAME else ["--served-model-name", a.served_name]
    cmd = [script, a.vllm_dir, model_dir, str(port), *name, *shlex.split(a.vllm_args)]
    launched = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, check=True)
    pid = int(r.stdout.strip().split()[-1])
    return harness.adopt("vllm", pid, port, os.path.join(os.path.realpath(a.vllm_dir), f"server-{port}.log"), cmd,
                         launched)



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
    """``check_available``, retried every 10 s for up to ``--wait-peers`` s (a peer still building)."""
    deadline = time.monotonic() + a.wait_peers
    why = check_available(engine, a)
    if why and a.wait_peers > 0:
        print(f"[{engine}] waiting up to {a.wait_peers:.0f} s: {why}", file=sys.stderr)
    while why and time.monotonic() < deadline:
        time.sleep(10)
        why = check_available(engine, a)
    return why
