"""Constrained decoding's cost, side by side in one run against one server.

Three phases of 16 concurrent chat requests (128 output tokens each, greedy):

  plain   every request unconstrained
  all     every request under a realistic JSON schema (an order with line items; long enough that
          every request runs to max_tokens, so both phases generate the same token count)
  one     one constrained request among 15 unconstrained ones

repeated ``--repeats`` times, and prints per round and as the median of the rounds: aggregate
output tok/s of ``all`` over ``plain`` (target >= 0.9x), the 15 unconstrained requests' mean
per-token latency in ``one`` against ``plain``'s (as a speed ratio; target >= 0.97x),
and the server's mask time per constrained token (``cpuserve:step_structured_mask_seconds``).  Then,
offline on the bundled tokenizer, the mask time per token (mean, p99) of llguidance and, when it is
importable (``--xgrammar-path`` adds a directory to sys.path; it is not a dependency), xgrammar, on
the same schema and the same output.

    .venv/bin/python benchmarks/structured.py --ours-args "--threads 2"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import sys
import time
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import httpx  # noqa: E402

from benchmarks import compare, harness  # noqa: E402

ORDER = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{6}$"},
        "customer": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 40}, "email": {"type": "string", "maxLength": 60},
                           "tier": {"enum": ["free", "pro", "enterprise"]}},
            "required": ["name", "email", "tier"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "minItems": 40,
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string", "maxLength": 12}, "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                               "price": {"type": "number", "minimum": 0}},
                "required": ["sku", "qty", "price"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["order_id", "customer", "items"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER, "strict": True}}


async def _one(client: httpx.AsyncClient, i: int, constrained: bool, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": compare.SERVED_NAME, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "messages": [{"role": "user", "content": f"Order #{i}: write it as JSON with its line items."}],
    }
    if constrained:
        body["response_format"] = FORMAT
    t0 = time.perf_counter()
    r = await client.post("/v1/chat/completions", json=body)
    r.raise_for_status()
    out = r.json()
    return {"constrained": constrained, "e2e": time.perf_counter() - t0, "tokens": out["usage"]["completion_tokens"],
            "finish": out["choices"][0]["finish_reason"], "text": out["choices"][0]["message"]["content"]}


async def phase(url: str, constrained: list[bool], max_tokens: int) -> tuple[float, list[dict[str, Any]]]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(_one(client, i, c, max_tokens) for i, c in enumerate(constrained)))
        return time.perf_counter() - t0, list(results)


def scrape_mask(url: str) -> tuple[float, float]:
    """(sum, count) of the per-step mask-time histogram."""
    text = httpx.get(url + "/metrics", timeout=30).text
    vals = {}
    for line in text.splitlines():
        for key in ("step_structured_mask_seconds_sum", "step_structured_mask_seconds_count"):
            if line.startswith("cpuserve:" + key):
                vals[key] = float(line.rsplit(" ", 1)[1])
    return vals.get("step_structured_mask_seconds_sum", 0.0), vals.get("step_structured_mask_seconds_count", 0.0)


def mask_probe(text: str, xgrammar_path: Optional[str]) -> dict[str, tuple[float, float, float]]:
    """Per grammar engine: (compile ms, mask us per token mean, p99) for ORDER over ``text``'s tokens."""
    import gguf

    from engine.loader import resolve_model_path
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(gguf.GGUFReader(resolve_model_path("default")))
    ids = tok.encode(text, add_special_tokens=False)
    out = {}

    import llguidance as llg
    import llguidance.torch as llt

    lt = llg.LLTokenizer(tok.backend.to_str(), n_vocab=tok.vocab_size, eos_token=list(tok.eos_token_ids))
    t0 = time.perf_counter()
    m = llg.LLMatcher(lt, llg.LLMatcher.grammar_from_json_schema(ORDER, defaults={"whitespace_flexible": False}))
    compile_ms = 1e3 * (time.perf_counter() - t0)
    mask = llt.allocate_token_bitmask(1, tok.vocab_size)
    times = []
    for t in ids:
        s = time.perf_counter()
        llt.fill_next_token_bitmask(m, mask, 0)
        times.append(time.perf_counter() - s)
        if not m.consume_token(t):
            break
    out["llguidance"] = (compile_ms, *_mean_p99(times))

    if xgrammar_path:
        sys.path.insert(0, xgrammar_path)
    try:
        import transformers
        import xgrammar as xgr
    except ImportError:
        return out
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.backend)
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=tok.vocab_size, stop_token_ids=list(tok.eos_token_ids))
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    t0 = time.perf_counter()
    cg = compiler.compile_json_schema(json.dumps(ORDER), any_whitespace=False, separators=(",", ":"))
    compile_ms = 1e3 * (time.perf_counter() - t0)
    xm = xgr.GrammarMatcher(cg)
    bitmask = xgr.allocate_token_bitmask(1, tok.vocab_size)
    times = []
    for t in ids:
        s = time.perf_counter()
        xm.fill_next_token_bitmask(bitmask, 0)
        times.append(time.perf_counter() - s)
        if not xm.accept_token(t):
            break
    out["xgrammar"] = (compile_ms, *_mean_p99(times))
    return out


def _mean_p99(seconds: list[float]) -> tuple[float, float]:
    s = sorted(seconds)
    return 1e6 * statistics.mean(s), 1e6 * s[min(len(s) - 1, int(0.99 * len(s)))]


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", help="an already running cpuserve (else one is started)")
    p.add_argument("--ours-args", default="", help="extra flags for the server this starts")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3,
                   help="rounds of the three phases; ratios are taken within a round, then the median (one round moves +-0.1)")
    p.add_argument("--xgrammar-path", help="a directory holding xgrammar (pip install --target), for the mask-time comparison")
    p.add_argument("--log-dir", default="/tmp")
    a = p.parse_args(argv)

    srv = None
    url = a.base_url
    if url is None:
        srv = harness.launch_service("ours", ["--served-model-name", compare.SERVED_NAME, *shlex.split(a.ours_args)],
                                     os.path.join(a.log_dir, "structured-server.log"), env=dict(os.environ))
        srv.wait_healthy(600)
        url = srv.url
    c = a.concurrency
    rounds = []  # per round: (plain_s, plain, all_s, allc, one, mask seconds, mask steps)
    try:
        asyncio.run(phase(url, [True, False], 8))  # compile the schema and warm both paths
        for _ in range(a.repeats):
            plain_s, plain = asyncio.run(phase(url, [False] * c, a.max_tokens))
            m0 = scrape_mask(url)
            all_s, allc = asyncio.run(phase(url, [True] * c, a.max_tokens))
            m1 = scrape_mask(url)
            _, one = asyncio.run(phase(url, [True] + [False] * (c - 1), a.max_tokens))
            rounds.append((plain_s, plain, all_s, allc, one, m1[0] - m0[0], m1[1] - m0[1]))
    finally:
        if srv is not None:
            srv.stop()

    tps = lambda rs, secs: sum(r["tokens"] for r in rs) / secs  # noqa: E731
    per_tok = lambda rs: statistics.mean(r["e2e"] / r["tokens"] for r in rs)  # noqa: E731
    print(f"{c} concurrent chat requests, {a.max_tokens} tokens each, greedy; {a.repeats} round(s) of the three phases")
    print("| round | plain tok/s | all constrained tok/s | all / plain | neighbours of one, speed vs plain | mask us/token |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    all_ratio, one_ratio = [], []
    for i, (plain_s, plain, all_s, allc, one, mask_s, steps) in enumerate(rounds, 1):
        others = [r for r in one if not r["constrained"]]
        all_ratio.append(tps(allc, all_s) / tps(plain, plain_s))
        one_ratio.append(per_tok(plain) / per_tok(others))
        mask_us = 1e6 * mask_s / max(1, sum(r["tokens"] for r in allc))
        print(f"| {i} | {tps(plain, plain_s):.1f} | {tps(allc, all_s):.1f} | {all_ratio[-1]:.3f}x | {one_ratio[-1]:.3f}x | "
              f"{mask_us:.1f} |")
    finishes = sorted({r["finish"] for rnd in rounds for r in rnd[3]})
    print(f"constrained finish reasons: {','.join(finishes)}")
    print(f"all constrained / plain, aggregate tok/s, median of rounds: {statistics.median(all_ratio):.3f}x (target >= 0.9x)")
    print(f"unconstrained neighbours of one constrained request, speed vs plain, median of rounds: "
          f"{statistics.median(one_ratio):.3f}x (target >= 0.97x)")
    mask_s, steps = sum(r[5] for r in rounds), sum(r[6] for r in rounds)
    const_tokens = sum(r["tokens"] for rnd in rounds for r in rnd[3])
    if const_tokens:
        print(f"server mask time (build + apply) per constrained token: {1e6 * mask_s / const_tokens:.1f} us "
              f"over {int(steps)} steps ({1e3 * mask_s / max(steps, 1):.3f} ms per step)")
    allc = rounds[-1][3]
    valid = [r for r in allc if r["finish"] == "length"]
    sample = max(valid or allc, key=lambda r: r["tokens"])["text"]
    print("offline mask time per token on the bundled tokenizer (same schema, one constrained output):")
    print("| engine | compile ms | mask us/token mean | p99 |")
    print("| --- | ---: | ---: | ---: |")
    for name, (ms, mean, p99) in mask_probe(sample, a.xgrammar_path).items():
        print(f"| {name} | {ms:.1f} | {mean:.1f} | {p99:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
