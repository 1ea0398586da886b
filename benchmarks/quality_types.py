"""What each GGUF weight type and KV-cache type costs in accuracy: KL divergence and top-1 agreement.

The bundled SmolLM2-135M weights (its Q4_1 file) are requantized with llama.cpp's
``llama-quantize --allow-requantize`` into Q4_K_M, Q5_K_M, Q6_K, Q8_0 and Q4_0 files (and, asked for,
IQ4_XS, Q3_K_M and Q2_K), made once into
a cache directory outside the repository.  Each file is served as the server serves it (bf16,
``--weight-quant auto``) with each KV-cache type, and every position of a few thousand tokens of
English text is compared with the float32 dense reference (the same Q4_1 weights dequantized, run
in float32): the mean KL divergence of the reference's next-token distribution to the served one
(KL(P_ref || P), as llama.cpp's ``llama-perplexity --kl-divergence`` computes it) and how often both
put the same token first.  The text is the PyTorch README that the pinned ``torch`` package ships
as its metadata (``importlib.metadata.metadata("torch").get_payload()``): real English prose with
some Markdown, and stable for a given torch version.  It goes through in windows of ``--window``
tokens, each a prompt of its own starting at BOS, as ``llama-perplexity`` goes through its chunks.

Next to each type stands the mean KLD (and top-1 agreement, where given) that llama.cpp publishes
for it: much larger models than this one, measured against FP16 on Wikitext-2, so a range to place
ours in, not a target; small models lose more to the same quantization.

    python -m benchmarks.quality_types                            # ~10 min on 2 cores
    python -m benchmarks.quality_types --types q8_0,q4_k_m --kv-dtypes auto --tokens 2048
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks.bench_serve_prompts import default_gguf_path  # noqa: E402
from benchmarks.model_shapes import read_tensor_infos  # noqa: E402

DEFAULT_TYPES = ("q4_k_m", "q5_k_m", "q6_k", "q8_0", "q4_0")
KV_DTYPES = ("auto", "bfloat16", "fp8_e4m3", "fp8_e5m2")
DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "cpuserve-bench", "quality")
DEFAULT_QUANTIZE = "/work/peers/llama/build/bin/llama-quantize"
TEXT_PACKAGE = "torch"

# llama.cpp's published mean KLD and "same top p" (top-1 agreement, %) against FP16 logits on
# Wikitext-2, without an importance matrix: tools/perplexity/README.md of
# https://github.com/ggml-org/llama.cpp, tables "LLaMA 3 8b Scoreboard" and "LLaMA 2 vs. LLaMA 3
# Quantization comparison" (revision f364eb6f, CUDA backend).  Per type: {model: (mean KLD, top-1 %)}.
PUBLISHED_SOURCE = ("llama.cpp tools/perplexity/README.md (LLaMA 3 8b Scoreboard; LLaMA 2 vs. LLaMA 3 "
                    "Quantization comparison; revision f364eb6f; Wikitext-2, against FP16, no imatrix)")
PUBLISHED: dict[str, dict[str, tuple[float, Optional[float]]]] = {
    "q8_0": {"L2 7B": (0.000369, 98.846), "L3 8B": (0.001355, 97.674)},
    "q6_k": {"L2 7B": (0.002098, 97.520), "L3 8B": (0.005452, 96.031)},
    "q5_k_m": {"L3 8B": (0.010762, None)},
    "q4_k_m": {"L2 7B": (0.012686, 94.665), "L3 8B": (0.031273, 91.901)},
    "q4_1": {"L3 8B": (0.071683, None)},
    "q4_0": {"L3 8B": (0.071940, None)},
    "iq4_xs": {"L3 8B, imatrix": (0.036334, None)},  # the scoreboard lists IQ4_XS with an imatrix only
    "q3_k_m": {"L3 8B": (0.101913, None)},
    "q2_k": {"L2 7B": (0.108903, 85.584), "L3 8B": (0.445132, 71.138)},
}


@dataclass(frozen=True)
class WeightFile:
    """One row of the table: ``label`` as printed, ``path`` of the GGUF (None: the source file's
    weights as dense bf16), ``weight_quant`` the engine runs it with."""

    label: str
    key: str  # lower-case type, the PUBLISHED key
    path: str
    weight_quant: str = "auto"


def source_stem(source: str) -> str:
    """The source GGUF's name without its type suffix: ``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``SmolLM2-135M-Instruct``."""
    stem = os.path.basename(source)
    if stem.endswith(".gguf"):
        stem = stem[: -len(".gguf")]
    head, dot, tail = stem.rpartition(".")
    return head if dot and tail.upper().startswith(("Q", "F", "BF", "IQ")) else stem


def type_path(cache_dir: str, source: str, gguf_type: str) -> str:
    """Where the ``gguf_type`` copy of ``source`` lives in the cache: ``<stem>.<TYPE>.gguf``."""
    return os.path.join(cache_dir, f"{source_stem(source)}.{gguf_type.upper()}.gguf")


def quantize_command(quantize_bin: str, source: str, out: str, gguf_type: str, threads: int) -> list[str]:
    """The llama-quantize command that makes ``out`` from ``source``: ``--allow-requantize``, as the
    source is itself quantized (its weights are dequantized to float32 and quantized again)."""
    return [quantize_bin, "--allow-requantize", source, out, gguf_type.upper(), str(threads)]


def ensure_type_file(cache_dir: str, source: str, gguf_type: str, quantize_bin: str) -> str:
    """The ``gguf_type`` copy of ``source``, made with llama-quantize if the cache lacks it (it is
    written under a temporary name and renamed, so that a run stopped half-way leaves no bad file)."""
    out = type_path(cache_dir, source, gguf_type)
    if os.path.isfile(out):
        return out
    if not os.access(quantize_bin, os.X_OK):
        raise SystemExit(f"{out} is missing and {quantize_bin} is not there to make it; build llama.cpp "
                         "(/work/shared/peers/setup_llama_server.sh DIR, then cmake --build DIR/build --target "
                         "llama-quantize) and pass --llama-quantize DIR/build/bin/llama-quantize")
    os.makedirs(cache_dir, exist_ok=True)
    tmp = f"{out}.tmp{os.getpid()}"
    cmd = quantize_command(quantize_bin, source, tmp, gguf_type, os.cpu_count() or 1)
    print(f"[quality] making {out}: {' '.join(cmd)}", file=sys.stderr)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise SystemExit(f"llama-quantize failed ({r.returncode}):\n{r.stdout[-1500:]}{r.stderr[-1500:]}")
    os.replace(tmp, out)
    return out


def english_text() -> str:
    """The PyTorch README shipped as the installed torch's package metadata (see the module docstring)."""
    import importlib.metadata

    text = importlib.metadata.metadata(TEXT_PACKAGE).get_payload()
    if not text or len(text) < 5000:
        raise SystemExit(f"the {TEXT_PACKAGE} package's metadata has no long description to measure on")
    return text


def windows(ids: list[int], window: int, total: int, bos: Optional[int]) -> list[list[int]]:
    """``total`` text tokens cut into prompts of ``window`` tokens, each opening with ``bos`` (if the
    model uses one) followed by the next ``window - 1`` (or ``window``) text tokens; a last, shorter
    window is dropped when under half a window.  Each prompt gives ``len - 1`` scored positions."""
    step = window - (1 if bos is not None else 0)
    ids = ids[:total]
    out = []
    for i in range(0, len(ids), step):
        chunk = ids[i:i + step]
        if len(chunk) < step // 2:
            break
        out.append(([bos] if bos is not None else []) + chunk)
    return out


def kld_stats(ref_logprobs: torch.Tensor, logits: torch.Tensor) -> dict:
    """Per-position KL(P_ref || P) and top-1 agreement of ``logits`` [positions, vocab] against the
    reference's log-probabilities [positions, vocab], summed (so that windows can be pooled)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    kl = (ref_logprobs.exp() * (ref_logprobs - logp)).sum(-1)
    return {"kld_sum": float(kl.sum()), "kld_max": float(kl.max()), "top1_same": int((logp.argmax(-1) == ref_logprobs.argmax(-1)).sum()),
            "positions": int(kl.numel())}


def pool(parts: list[dict]) -> dict:
    """One result from every window's ``kld_stats``: mean KLD, largest KLD, top-1 agreement."""
    n = sum(p["positions"] for p in parts)
    return {"mean_kld": sum(p["kld_sum"] for p in parts) / n, "max_kld": max(p["kld_max"] for p in parts),
            "top1": sum(p["top1_same"] for p in parts) / n, "positions": n}


def published_text(key: str) -> str:
    """llama.cpp's published figures for one type, e.g. ``0.0127 / 94.7% (L2 7B); 0.0313 / 91.9% (L3 8B)``."""
    pub = PUBLISHED.get(key)
    if not pub:
        return "-"
    return "; ".join(f"{kld:.4f}" + (f" / {top1:.1f}%" if top1 is not None else "") + f" ({model})"
                     for model, (kld, top1) in pub.items())


def kld_table(rows: list[dict], kv_labels: dict[str, str]) -> str:
    """The markdown table: one row per weight file (``label``, ``key``, ``bpw``, ``results`` mapping KV
    dtype to a ``pool`` result), a mean-KLD and a top-1 column per KV dtype in ``kv_labels`` order,
    and llama.cpp's published figures for the type last."""
    head = ["weights", "bits/weight"]
    for label in kv_labels.values():
        head += [f"KV {label}: mean KLD", f"KV {label}: top-1"]
    head.append("llama.cpp published: mean KLD / top-1")
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(["---"] * len(head)) + " |"]
    for r in rows:
        cells = [r["label"], f"{r['bpw']:.2f}"]
        for kv in kv_labels:
            res = r["results"].get(kv)
            cells += [f"{res['mean_kld']:.4f}", f"{100 * res['top1']:.1f}%"] if res else ["n/a", "n/a"]
        cells.append(published_text(r["key"]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def bits_per_weight(path: str) -> float:
    """Stored bits per weight over all tensors of a GGUF file."""
    infos = read_tensor_infos(path)
    return 8 * sum(t.n_bytes for t in infos) / sum(t.n_elements for t in infos)


def main(argv: Optional[list[str]] = None) -> int:
    from benchmarks.quality import NUM_BLOCKS, prompt_logits
    from engine.config import CacheConfig, EngineConfig
    from engine.engine import LLMEngine
    from engine.loader import load_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default=",".join(DEFAULT_TYPES),
                    help="llama-quantize types to make from the bundled file and measure (the bundled Q4_1 and "
                         "its weights as dense bf16 are always measured)")
    ap.add_argument("--kv-dtypes", default=",".join(KV_DTYPES), help=f"KV-cache types, of {','.join(KV_DTYPES)}, int8")
    ap.add_argument("--tokens", type=int, default=4096, help="text tokens scored (the text has about 8,000)")
    ap.add_argument("--window", type=int, default=1024, help="tokens per prompt (BOS included)")
    ap.add_argument("--cache-dir", default=DEFAULT_CACHE, help="where the requantized files are made and kept")
    ap.add_argument("--llama-quantize", default=DEFAULT_QUANTIZE, help="llama.cpp's llama-quantize binary")
    ap.add_argument("--large-batch-matmul", default="auto",
                    help="the engine's large_batch_matmul (int8: prompts on the packed blocks even where the "
                         "row-int8 copies would fit, as on models that are too big for them)")
    ap.add_argument("--json-out")
    args = ap.parse_args(argv)
    if args.window + 1 > NUM_BLOCKS * 16:
        raise SystemExit(f"--window: at most {NUM_BLOCKS * 16 - 1}")
    kv_dtypes = [k.strip() for k in args.kv_dtypes.split(",") if k.strip()]
    unknown = sorted(set(kv_dtypes) - set(KV_DTYPES) - {"int8"})
    if unknown:  # before the minutes the reference takes, not after
        raise SystemExit(f"--kv-dtypes: {', '.join(unknown)} unknown; of {', '.join(KV_DTYPES)}, int8")

    t0 = time.time()
    source = default_gguf_path()
    files = [WeightFile("bf16 dense (the Q4_1 weights dequantized)", "bf16", source, "none"),
             WeightFile(f"{os.path.basename(source)} (bundled)", "q4_1", source)]
    for t in (t.strip().lower() for t in args.types.split(",") if t.strip()):
        files.append(WeightFile(t.upper(), t, ensure_type_file(args.cache_dir, source, t, args.llama_quantize)))

    ref_engine = LLMEngine(EngineConfig(model=source, dtype="float32", weight_quant="none",
                                        cache=CacheConfig(num_blocks=NUM_BLOCKS)))
    tok = ref_engine.tokenizer
    ids = tok.encode(english_text(), add_special_tokens=False)
    prompts = windows(ids, args.window, args.tokens, tok.bos_token_id if tok.add_bos else None)
    print(f"[quality] reference: float32 dense, {len(prompts)} windows of {args.window} tokens "
          f"({len(ids)} tokens of text in all)", file=sys.stderr)
    refs = [torch.log_softmax(prompt_logits(ref_engine, p), dim=-1) for p in prompts]
    del ref_engine

    rows = []
    kv_labels: dict[str, str] = {}
    print(f"[quality] reference done at {time.time() - t0:.0f} s", file=sys.stderr)
    for f in files:
        loaded = load_model(f.path, torch.bfloat16)
        print(f"[quality] loaded {f.label} at {time.time() - t0:.0f} s", file=sys.stderr)
        row = {"label": f.label, "key": f.key, "path": f.path, "bpw": 16.0 if f.weight_quant == "none" else bits_per_weight(f.path),
               "results": {}}
        for kv in kv_dtypes:
            engine = LLMEngine(EngineConfig(model=f.path, dtype="bfloat16", weight_quant=f.weight_quant,
                                            large_batch_matmul=args.large_batch_matmul,
                                            cache=CacheConfig(num_blocks=NUM_BLOCKS, kv_cache_dtype=kv)), loaded=loaded)
            resolved = engine.config.cache.kv_cache_dtype
            kv_labels.setdefault(kv, kv if resolved == kv else f"{kv} ({resolved})")
            row["results"][kv] = res = pool([kld_stats(r, prompt_logits(engine, p)) for r, p in zip(refs, prompts)])
            print(f"[quality] {f.label}, KV {kv_labels[kv]}: mean KLD {res['mean_kld']:.5f}, "
                  f"top-1 {100 * res['top1']:.2f}% (at {time.time() - t0:.0f} s)", file=sys.stderr)
            del engine
        rows.append(row)
        del loaded

    positions = rows[0]["results"][kv_dtypes[0]]["positions"] if rows and kv_dtypes else 0
    print(f"\nAgainst the float32 dense reference, {positions} positions of the PyTorch README (torch "
          f"{__import__('importlib.metadata').metadata.version(TEXT_PACKAGE)} package metadata) in windows of "
          f"{args.window} tokens; served as bf16 with --weight-quant auto, large-batch matmuls {args.large_batch_matmul} ({time.time() - t0:.0f} s).\n")
    print(kld_table(rows, kv_labels))
    print(f"\nllama.cpp published: {PUBLISHED_SOURCE}; L2 7B = LLaMA 2 7B, L3 8B = LLaMA 3 8B.")
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump({"rows": rows, "kv_labels": kv_labels, "published": PUBLISHED, "published_source": PUBLISHED_SOURCE,
                       "window": args.window, "tokens": args.tokens}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
