"""Benchmark models of real shapes, and the memory-bandwidth floor of batch-1 decode.

A model directory made by /work/shared/models/make_random_model.sh (or any directory laid out
the same way) holds the same weights in several files:

    DIR/hf/             Hugging Face layout (bf16 safetensors + tokenizer): what vLLM-CPU loads
    DIR/f16.gguf        llama.cpp's converter output
    DIR/<type>.gguf     llama-quantize output per type: q4_k_m.gguf, q5_k_m.gguf, q6_k.gguf, q8_0.gguf, ...

``resolve_model`` picks the GGUF of one type (what ours and llama-server run) and the HF
directory (what vLLM runs) out of it.  Batch-1 decode reads every weight once a token, so its
time per output token cannot fall below (bytes of weights read a token) / (memory read
bandwidth): ``weight_read_bytes`` counts the first from the GGUF's tensors, ``measure_read_bandwidth``
measures the second, and ``decode_floor_ms`` divides them.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Iterable, Optional

HF_SUBDIR = "hf"
DEFAULT_GGUF_TYPE = "q4_k_m"


@dataclass(frozen=True)
class ModelFiles:
    """One benchmark model: ``name`` (served name), ``gguf`` (ours and llama-server), ``hf_dir``
    (vLLM-CPU; None where there is none) and ``gguf_type`` (the file's stem, e.g. ``q4_k_m``)."""

    name: str
    gguf: str
    hf_dir: Optional[str]
    gguf_type: str


def gguf_types(model_dir: str) -> list[str]:
    """The weight types a model directory has files for (``<type>.gguf`` stems, sorted)."""
    try:
        names = os.listdir(model_dir)
    except OSError:
        return []
    return sorted(n[: -len(".gguf")] for n in names if n.endswith(".gguf") and not n.startswith("."))


def resolve_model(model_dir: Optional[str] = None, gguf_type: str = DEFAULT_GGUF_TYPE, gguf: Optional[str] = None,
                  hf_dir: Optional[str] = None, name: Optional[str] = None) -> ModelFiles:
    """The files of one benchmark model: from a model directory (``DIR/<gguf_type>.gguf`` and
    ``DIR/hf``), or from an explicit ``gguf`` file (and ``hf_dir``), each explicit path winning
    over the directory's.  The served name is ``name``, else the directory's base name, else the
    GGUF's stem.  Raises FileNotFoundError, naming the types there are, when a file is missing."""
    if model_dir is None and gguf is None:
        raise ValueError("need a model directory or a GGUF file")
    gguf_type = gguf_type.lower()
    if gguf is None:
        gguf = os.path.join(model_dir, f"{gguf_type}.gguf")
        if not os.path.isfile(gguf):
            have = gguf_types(model_dir)
            raise FileNotFoundError(f"{gguf} does not exist; {model_dir} has: {', '.join(have) or 'no .gguf files'}")
    elif not os.path.isfile(gguf):
        raise FileNotFoundError(f"{gguf} does not exist")
    else:
        gguf_type = os.path.splitext(os.path.basename(gguf))[0].lower()
    if hf_dir is None and model_dir is not None and os.path.isfile(os.path.join(model_dir, HF_SUBDIR, "config.json")):
        hf_dir = os.path.join(model_dir, HF_SUBDIR)
    if hf_dir is not None and not os.path.isfile(os.path.join(hf_dir, "config.json")):
        raise FileNotFoundError(f"{hf_dir} has no config.json (not a Hugging Face model directory)")
    if name is None:
        name = os.path.basename(os.path.normpath(model_dir)) if model_dir else gguf_type
    return ModelFiles(name=name, gguf=os.path.abspath(gguf), hf_dir=hf_dir and os.path.abspath(hf_dir),
                      gguf_type=gguf_type)


@dataclass(frozen=True)
class TensorInfo:
    """What the byte count needs of one GGUF tensor."""

    name: str
    n_bytes: int
    n_elements: int


def read_tensor_infos(gguf_path: str) -> list[TensorInfo]:
    """Name, stored bytes and element count of every tensor of a GGUF file (header only: the
    reader memory-maps the file and reads no tensor data)."""
    from gguf import GGUFReader

    reader = GGUFReader(gguf_path)
    return [TensorInfo(t.name, int(t.n_bytes), int(t.n_elements)) for t in reader.tensors]


def weight_read_bytes(tensors: Iterable[TensorInfo], bytes_per_element: Optional[float] = None) -> int:
    """Bytes of weights one batch-1 decode step reads: every tensor once, except that the token
    embedding is only looked up (one row) when the model has its own ``output.weight``; with tied
    embeddings it is the LM head too and is read whole.  ``bytes_per_element`` (e.g. 2 for a bf16
    copy) counts elements at that width instead of the stored bytes.  The KV cache and the
    activations are left out: at short contexts they are a small share."""
    tensors = list(tensors)
    has_output = any(t.name == "output.weight" for t in tensors)
    total = 0.0
    for t in tensors:
        if t.name == "token_embd.weight" and has_output:
            continue
        total += t.n_elements * bytes_per_element if bytes_per_element is not None else t.n_bytes
    return int(total)


def decode_floor_ms(bytes_per_token: float, bandwidth_bytes_s: float) -> float:
    """The least time per output token of batch-1 decode, in ms, at the given read bandwidth."""
    if bandwidth_bytes_s <= 0:
        raise ValueError("bandwidth must be positive")
    return 1000.0 * bytes_per_token / bandwidth_bytes_s


def measure_read_bandwidth(threads: int = 2, size_mb: int = 1024, repeats: int = 7) -> float:
    """Memory read bandwidth in bytes/s: the fastest of ``repeats`` float32 sums over a ``size_mb``
    MiB buffer (far larger than any cache) with ``threads`` torch threads, the buffer touched once
    first so that page faults are not timed.  A sum does one add per 4 bytes read, so on AVX2 /
    AVX-512 CPUs it runs at the rate memory delivers."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buf = torch.ones(size_mb * 2**20 // 4, dtype=torch.float32)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            float(buf.sum())
            best = min(best, time.perf_counter() - t0)
        return buf.numel() * 4 / best
    finally:
        torch.set_num_threads(old)


def floor_lines(bytes_gguf: int, bytes_bf16: int, bandwidth: float, gguf_type: str,
                tpot_ms: dict[str, Optional[float]], bandwidth_note: str = "") -> list[str]:
    """The floor as markdown lines under the comparison table: the bytes a token for the GGUF
    (what ours and llama-server load) and for bf16 weights (what vLLM-CPU runs), the measured
    bandwidth, each floor, and each engine's batch-1 TPOT as a multiple of its floor.
    ``tpot_ms`` maps engine titles to their c=1 TPOT p50 (None where not measured)."""
    floor_gguf = decode_floor_ms(bytes_gguf, bandwidth)
    floor_bf16 = decode_floor_ms(bytes_bf16, bandwidth)
    lines = [f"Batch-1 decode floor: {bytes_gguf / 1e6:.0f} MB of {gguf_type} weights a token "
             f"(bf16: {bytes_bf16 / 1e6:.0f} MB) / {bandwidth / 1e9:.1f} GB/s read bandwidth{bandwidth_note} "
             f"= {floor_gguf:.2f} ms ({gguf_type}), {floor_bf16:.2f} ms (bf16)."]
    for engine, tpot in tpot_ms.items():
        if tpot is None:
            continue
        bf16 = engine == "vLLM-CPU" or gguf_type == "bf16"
        floor = floor_bf16 if bf16 else floor_gguf
        lines.append(f"- {engine} c=1 TPOT p50 {tpot:.2f} ms = {tpot / floor:.2f} x its floor "
                     f"({'bf16' if bf16 else gguf_type}, {floor:.2f} ms)")
    return lines
