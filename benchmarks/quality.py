"""Numerical quality of the fast paths against the float32 reference, on the real model.

Every lower-precision path (bf16 activations, packed low-bit matmuls with 16- or 8-bit
activations, the row-int8 copies large batches use, int8 and fp8 KV caches) is run teacher-forced along
the float32 reference's own greedy continuation, one decode step at a time (so the decode
kernels are what is measured), and compared position by position: greedy agreement (same
argmax) and the largest logit difference.  A second table does the same for every position of
long prompts (this repository's own documents and code, read in chunks as a server reads
prompts), where the prompt kernels -- batched matmuls, prompt attention over the cache -- and what
they leave in the cache decide the logits.  Prints the tables; ``--json-out`` saves them.

    python -m benchmarks.quality --prompts 8 --tokens 48 --prompt-tokens 1000
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Iterator

import torch

from engine.config import CacheConfig, EngineConfig
from engine.engine import LLMEngine
from engine.loader import load_model
from engine.request import SamplingParams

PROMPTS = [
    "The history of the Roman Empire begins with",
    "def quicksort(arr):\n    ",
    "Photosynthesis is the process by which",
    "Here is a recipe for pancakes. Ingredients:",
    "The three laws of thermodynamics state that",
    "Once upon a time, a little robot named",
    "SELECT customers.name, SUM(orders.total) FROM",
    "The best way to learn a new language is",
    "In 1969, the Apollo 11 mission",
    "Dear hiring manager, I am writing to apply for",
    "The difference between a list and a tuple in Python is",
    "A haiku about the ocean:\n",
]


NUM_BLOCKS = 128  # 2048 tokens of KV cache per engine: one request at a time


@dataclass
class Variant:
    name: str
    dtype: str
    weight_quant: str
    kv_cache_dtype: str = "auto"
    env: dict | None = None
    every_batch_on_rows_int8: bool = False  # route even 1-row batches to the row-int8 copies


def route_every_batch_to_rows_int8(engine: LLMEngine) -> None:
    """Send every batch, decode steps included, to the row-int8 copies (by default only batches
    of ROWS_INT8_MIN_ROWS rows or more use them), so that their accuracy is what gets measured."""
    from engine.layers.linear import Linear

    lins = [m for m in engine.runner.model.modules() if isinstance(m, Linear) and m.rows_int8 is not None]
    if not lins:
        raise SystemExit("no row-int8 copies on this host (they need AVX-512 VNNI)")
    for lin in lins:
        lin.packed_max_rows, lin.rows_int8_min_rows = 0, 1
    engine.runner.model.bind_packed_layers()


VARIANTS = [
    Variant("bf16, dense weights, bf16 KV cache", "bfloat16", "none", "bfloat16"),
    # The default: 16-bit activations up to 4 rows (every decode step here), int8 above, the
    # row-int8 copies from the batch size timed at load (6-20 rows: the prompts); int8 KV cache.
    Variant("bf16, packed Q4/Q8 blocks (default: a16 <= 4 rows, int8 above, row-int8 from the timed switch, int8 KV)", "bfloat16", "auto"),
    Variant("bf16, packed blocks as the default, bf16 KV cache", "bfloat16", "auto", "bfloat16"),
    # What batches of 5 rows up to the row-int8 switch get by default (and every large batch with
    # --large-batch-matmul int8).
    Variant("bf16, packed blocks, int8 activations everywhere", "bfloat16", "auto", env={"CPUSERVE_PACKED_ACT_BITS": "8"}),
    # What batches from the row-int8 switch on get by default.
    Variant("bf16, row-int8 copies everywhere", "bfloat16", "auto", every_batch_on_rows_int8=True),
    Variant("bf16, packed blocks, fp8 e4m3 KV cache", "bfloat16", "auto", "fp8_e4m3"),
    Variant("fp32, packed blocks, 16-bit activations", "float32", "auto"),
]


@contextlib.contextmanager
def captured_logits(engine: LLMEngine) -> Iterator[list[torch.Tensor]]:
    """A float32 copy of every logits matrix the model computes while inside."""
    captured: list[torch.Tensor] = []
    model = engine.runner.model
    original = model.compute_logits

    def capture(hidden: torch.Tensor) -> torch.Tensor:
        out = original(hidden)
        captured.append(out.float().clone())
        return out

    model.compute_logits = capture  # type: ignore[method-assign]
    try:
        yield captured
    finally:
        model.compute_logits = original  # type: ignore[method-assign]


def forced_logits(engine: LLMEngine, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """Logits behind each continuation token, feeding the given continuation instead of the samples."""
    with captured_logits(engine) as captured:
        reqs = engine.add_request("q", prompt, SamplingParams(max_tokens=len(continuation), temperature=0, ignore_eos=True))
        req = reqs[0]
        while not req.is_finished:
            sched = engine.scheduler.schedule()
            engine.runner.execute(sched)
            forced = {s.request.request_id: continuation[req.num_output_tokens] for s in sched.scheduled if s.samples}
            engine.scheduler.update(sched, forced)
        engine.output.text_states.clear()
    return torch.stack([c[-1] for c in captured])


# Long prompts: texts every checkout has, mixing prose, tables, shell and Python.
PROMPT_FILES = ["README.md", "deploy/README.md", "benchmarks/README.md", "engine/scheduler.py"]


def prompt_logits(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """Logits at every prompt position (each predicting the next prompt token), as a request with
    prompt_logprobs gets them: the prompt goes through in the engine's usual chunks."""
    with captured_logits(engine) as captured:
        engine.add_request("p", ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
        while engine.has_unfinished():
            engine.step()
    return torch.cat(captured)[: len(ids) - 1]  # the last row predicts past the prompt


def compare(logits: list[torch.Tensor], refs: list[torch.Tensor]) -> dict:
    """Greedy agreement and logit differences of one variant against the reference, all positions pooled."""
    agree = sum(int((a.argmax(-1) == r.argmax(-1)).sum()) for a, r in zip(logits, refs))
    diffs = torch.cat([(a - r).abs().amax(-1) for a, r in zip(logits, refs)])
    return {
        "greedy_agreement": agree / len(diffs),
        "max_logit_diff": float(diffs.max()),
        "median_max_logit_diff": float(diffs.median()),
        "positions": len(diffs),
    }


def print_table(rows: list[dict]) -> None:
    print("| path | greedy agreement | max logit diff | median per position |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['variant']} | {100 * r['greedy_agreement']:.1f}% ({r['positions']} positions) | "
              f"{r['max_logit_diff']:.3f} | {r['median_max_logit_diff']:.3f} |")


def make_engine(v: Variant, loaded) -> LLMEngine:  # noqa: ANN001
    for key, value in (v.env or {}).items():
        os.environ[key] = value
    try:
        cfg = EngineConfig(
            model="default", dtype=v.dtype, weight_quant=v.weight_quant,
            cache=CacheConfig(num_blocks=NUM_BLOCKS, kv_cache_dtype=v.kv_cache_dtype),
        )
        engine = LLMEngine(cfg, loaded=loaded)
        if v.every_batch_on_rows_int8:
            route_every_batch_to_rows_int8(engine)
        return engine
    finally:
        for key in v.env or {}:
            os.environ.pop(key, None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--prompt-tokens", type=int, default=1000, help="tokens of each long prompt (0: skip that table)")
    ap.add_argument("--json-out")
    args = ap.parse_args(argv)
    if args.prompt_tokens + 1 > NUM_BLOCKS * 16:
        raise SystemExit(f"--prompt-tokens: at most {NUM_BLOCKS * 16 - 1}")

    t0 = time.time()
    ref_engine = LLMEngine(EngineConfig(model="default", dtype="float32", weight_quant="none", cache=CacheConfig(num_blocks=NUM_BLOCKS)))
    tok = ref_engine.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS[: args.prompts]]
    refs = []
    for p in prompts:
        out = ref_engine.add_request("r", p, SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True))
        req = out[0]
        while ref_engine.has_unfinished():
            ref_engine.step()
        refs.append(req.output_token_ids)
    ref_logits = [forced_logits(ref_engine, p, c) for p, c in zip(prompts, refs)]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    texts = []
    if args.prompt_tokens:
        for name in PROMPT_FILES:
            with open(os.path.join(root, name), encoding="utf-8") as f:
                texts.append(tok.encode(f.read())[: args.prompt_tokens])
    ref_prompt_logits = [prompt_logits(ref_engine, ids) for ids in texts]
    del ref_engine

    rows, prompt_rows = [], []
    loaded = {dtype: load_model("default", getattr(torch, dtype)) for dtype in ("bfloat16", "float32")}
    for v in VARIANTS:
        engine = make_engine(v, loaded[v.dtype])
        logits = [forced_logits(engine, p, c) for p, c in zip(prompts, refs)]
        rows.append({"variant": v.name, **compare(logits, ref_logits)})
        if texts:
            logits = [prompt_logits(engine, ids) for ids in texts]
            prompt_rows.append({"variant": v.name, **compare(logits, ref_prompt_logits)})
        del engine

    print(f"\nTeacher-forced against the float32 dense reference ({time.time() - t0:.0f} s).\n")
    print(f"Decode steps: {len(prompts)} prompts x {args.tokens} steps\n")
    print_table(rows)
    if prompt_rows:
        print(f"\nPrompt positions: {len(texts)} texts x {args.prompt_tokens} tokens ({', '.join(PROMPT_FILES)})\n")
        print_table(prompt_rows)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"decode": rows, "prompt": prompt_rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
