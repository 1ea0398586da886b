"""This engine against Hugging Face ``transformers`` ``generate``, offline, on the same weights.

Both load the same GGUF file (the bundled SmolLM2-135M-Instruct by default) in the same dtype
(bf16: transformers' fastest here too; ``--hf-dtype`` changes its) and thread count, and get
the same random 128-token prompts; every run asks for exactly
``--output-len`` tokens (``ignore_eos`` here, ``min_new_tokens`` there), greedy.  Printed side
by side, with ratios:

* batch-1 decode tokens/s: one prompt, (N - 1) / (time for N tokens - time for 1 token), so
  the prompt's prefill is not counted; the median of ``--repeats`` runs;
* offline throughput: ``--num-prompts`` prompts (64) handed over at once, output tokens/s.
  transformers' figure is batch 1 (its plain ``generate`` loop, one prompt after another:
  ``--num-prompts`` x the batch-1 time for N tokens), plus, with ``--hf-batched``, one padded
  batch of all the prompts.

    python -m benchmarks.vs_transformers                     # 64 prompts, 128 in, 128 out
    python -m benchmarks.vs_transformers --hf-batched --threads 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable

import torch

from engine.config import EngineConfig
from engine.llm import LLM
from engine.loader import resolve_model_path
from engine.request import SamplingParams


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Skip the low ids, where the special tokens live.
    return torch.randint(100, vocab, (n, length), generator=g).tolist()


def timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


Run = Callable[[list[list[int]], int], None]  # (prompts, output tokens): generate exactly that many


def measure(args: argparse.Namespace, run: Run, prompts: list[list[int]], batched: bool) -> dict[str, float]:
    """Batch-1 decode tokens/s and output tokens/s of one whole request (medians of ``--repeats``
    runs on the first prompts) and, if ``batched``, output tokens/s of the first ``--num-prompts``
    prompts handed over at once."""
    rates, totals = [], []
    for i in range(args.repeats):
        t1 = timed(lambda: run([prompts[i]], 1))
        tn = timed(lambda: run([prompts[i]], args.output_len))
        rates.append((args.output_len - 1) / (tn - t1))
        totals.append(tn)
    result = {"decode_tok_s": statistics.median(rates), "batch1_tok_s": args.output_len / statistics.median(totals)}
    if batched:  # equal-length prompts: no padding anywhere
        batch = prompts[: args.num_prompts]
        result["offline_tok_s"] = len(batch) * args.output_len / timed(lambda: run(batch, args.output_len))
    return result


def ours(args: argparse.Namespace, llm: LLM, prompts: list[list[int]]) -> dict[str, float]:
    def run(batch: list[list[int]], n: int) -> None:
        outs = llm.generate(batch, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        assert all(len(o.outputs[0].token_ids) == n for o in outs)

    run(prompts[:4], 4)  # warm-up: kernels, allocator
    return measure(args, run, prompts, batched=True)


def hf(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(args.model)
    dtype = getattr(torch, args.hf_dtype or args.dtype)
    if os.path.isfile(path):  # GGUF: transformers dequantizes it (needs `accelerate`)
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path), dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.eval()

    @torch.inference_mode()
    def run(batch: list[list[int]], n: int) -> None:
        ids = torch.tensor(batch)
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False,
            pad_token_id=model.config.eos_token_id if model.config.pad_token_id is None else model.config.pad_token_id,
        )
        assert out.shape[1] == ids.shape[1] + n

    run(prompts[:1], 4)
    return measure(args, run, prompts, batched=args.hf_batched)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="GGUF file, Hugging Face directory, or 'default'")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--hf-dtype", default="", choices=["bfloat16", "float32", ""],
                    help="transformers' dtype ('' = --dtype).  It suggests float32 for GGUF files, but bf16 "
                    "ran it ~1.8x faster here (44 vs 25 tok/s at batch 1)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads for both (default: torch's)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="batch-1 runs per engine (median)")
    ap.add_argument("--hf-batched", action="store_true", help="also time transformers on one batch of every prompt")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    args.threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(args.threads)

    t0 = time.perf_counter()
    llm = LLM(config=EngineConfig(model=args.model, dtype=args.dtype, num_threads=args.threads))
    vocab = llm.engine.model_config.vocab_size
    prompts = random_prompts(max(args.num_prompts, args.repeats), args.input_len, vocab, args.seed)
    print(f"{args.num_prompts} prompts x {args.input_len} tokens in, {args.output_len} out, greedy, "
          f"ours {args.dtype}, transformers {args.hf_dtype or args.dtype}, {args.threads} threads", flush=True)
    a = ours(args, llm, prompts)
    del llm
    print(f"  ours done in {time.perf_counter() - t0:.0f} s", flush=True)
    t0 = time.perf_counter()
    b = hf(args, prompts)
    print(f"  transformers done in {time.perf_counter() - t0:.0f} s\n", flush=True)

    rows = [
        ("batch-1 decode (tok/s)", a["decode_tok_s"], b["decode_tok_s"], "transformers batch 1"),
        # transformers batch 1, one prompt after another: each takes the time of one whole request
        (f"offline, {args.num_prompts} prompts (output tok/s)", a["offline_tok_s"], b["batch1_tok_s"],
         "transformers batch 1"),
    ]
    if "offline_tok_s" in b:
        rows.append((f"offline, {args.num_prompts} prompts (output tok/s)", a["offline_tok_s"],
                     b["offline_tok_s"], f"transformers batch {args.num_prompts}"))
    print("| workload | ours | transformers | vs | ours / transformers |")
    print("| --- | --- | --- | --- | --- |")
    for name, x, y, vs in rows:
        print(f"| {name} | {x:.1f} | {y:.1f} | {vs} | {x / y:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
