"""Engine behaviour a user would notice, on the real default model in float32.

Batch invariance, chunked prefill, preemption, prefix caching, n > 1, aborts and
no leaked KV blocks.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import LLMEngine, RequestError
from engine.loader import load_model
from engine.request import SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a",
    "List three colors:",
    "The meaning of life is",
    "Water boils at a temperature of",
    "import numpy as np\n\ndef softmax(x):",
    "My favourite book is",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Translate to French: cheese",
    "In 1492, Columbus",
    "The square root of 144 is",
    "Here is a haiku about autumn:",
    "SELECT name FROM users WHERE",
    "Q: What is the largest planet?\nA:",
    "Dear Sir or Madam, I am writing to",
]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded():
    return load_model("default", torch.float32)


def make_engine(loaded, num_blocks=512, max_batched=2048, max_seqs=64, prefix=True, dtype="float32") -> LLMEngine:
    cfg = EngineConfig(
        model="default",
        dtype=dtype,
        weight_quant="none",
        cache=CacheConfig(num_blocks=num_blocks, enable_prefix_caching=prefix),
        scheduler=SchedulerConfig(max_num_batched_tokens=max_batched, max_num_seqs=max_seqs),
    )
    return LLMEngine(cfg, loaded=loaded)


def run(engine: LLMEngine, prompts, params=GREEDY, abort_after: dict | None = None):
    """Run prompts to completion; returns ({id: tokens}, {id: text}, [StepStats])."""
    tokens, texts, steps = {}, {}, []
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
        tokens[str(i)], texts[str(i)] = [], ""
    n_steps = 0
    while engine.has_unfinished():
        deltas, stats, _ = engine.step()
        n_steps += 1
        if stats:
            steps.append(stats)
        for d in deltas:
            tokens[d.request_id] = tokens.get(d.request_id, []) + d.new_token_ids
            texts[d.request_id] = texts.get(d.request_id, "") + d.new_text
        for rid, at in (abort_after or {}).items():
            if n_steps == at:
                engine.abort_request(rid)
    return tokens, texts, steps


@pytest.fixture(scope="module")
def alone(loaded):
    engine = make_engine(loaded)
    return run(engine, PROMPTS[:1])[0]["0"]


def test_batch_invariance_batched_with_15_others(loaded, alone):
    engine = make_engine(loaded)
    tokens, _, steps = run(engine, PROMPTS)
    assert max(s.num_running for s in steps) == 16
    assert tokens["0"] == alone
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_batch_invariance_under_chunked_prefill(loaded, alone):
    engine = make_engine(loaded, max_batched=3)  # every prompt split into 3-token chunks
    tokens, _, steps = run(engine, PROMPTS[:4])
    assert tokens["0"] == alone
    assert max(s.num_prefill_tokens for s in steps) <= 3
    assert max(s.num_tokens for s in steps) <= 3 + 4  # running decodes ride on top of the prompt budget


def test_batch_invariance_after_preemption(loaded, alone):
    engine = make_engine(loaded, num_blocks=6, prefix=False)  # 96 token slots for 16 requests
    tokens, _, steps = run(engine, PROMPTS)
    assert sum(s.num_preemptions for s in steps) > 0
    assert tokens["0"] == alone
    reference = make_engine(loaded)
    ref_tokens, _, _ = run(reference, PROMPTS)
    assert tokens == ref_tokens  # every request, not just the first, survives recomputation unchanged
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_prefix_cache_hit_gives_same_output(loaded):
    shared = "You are a helpful assistant. Answer briefly and precisely. " * 4
    a, b = shared + "What is 2+2?", shared + "Name a fruit."
    cold = make_engine(loaded, prefix=False)
    expected = run(cold, [b])[0]["0"]
    engine = make_engine(loaded)
    run(engine, [a])
    tokens, _, steps = run(engine, [b])
    hits = sum(s.prefix_cache_hits for s in steps)
    assert hits >= 32  # at least two full 16-token blocks came from the cache
    assert tokens["0"] == expected


def test_n_greater_than_one_shares_prompt_blocks(loaded):
    engine = make_engine(loaded)
    prompt = "Write a short poem about the sea. " * 3
    params = SamplingParams(n=3, max_tokens=6, temperature=0.8, seed=7, ignore_eos=True)
    engine.add_request("p", prompt, params)
    outs, hits = {}, 0
    while engine.has_unfinished():
        deltas, stats, _ = engine.step()
        hits += stats.prefix_cache_hits if stats else 0
        for d in deltas:
            assert d.parent_id == "p"
            outs.setdefault(d.index, []).extend(d.new_token_ids)
    assert sorted(outs) == [0, 1, 2] and all(len(v) == 6 for v in outs.values())
    n_prompt = len(engine.tokenizer.encode(prompt))
    assert hits >= 2 * (n_prompt // 16) * 16  # choices 1 and 2 reuse choice 0's full blocks
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_abort_at_every_stage_frees_every_block(loaded):
    engine = make_engine(loaded, max_batched=8)
    long_prompt = "word " * 40
    engine.add_request("waiting", "never scheduled " * 3, GREEDY)
    engine.abort_request("waiting")
    tokens, _, _ = run(engine, [long_prompt, "Hello", "Count: 1, 2, 3,"], abort_after={"0": 2, "1": 4})
    assert len(tokens["0"]) == 0  # aborted mid-prefill
    assert 0 < len(tokens["1"]) < GREEDY.max_tokens  # aborted mid-decode
    assert len(tokens["2"]) == GREEDY.max_tokens
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert not engine.scheduler.requests and not engine.text_states


def test_rejects_requests_that_cannot_run(loaded):
    engine = make_engine(loaded)
    with pytest.raises(RequestError, match="outside the vocabulary"):
        engine.add_request("x", [1, 2, 10**9], GREEDY)
    with pytest.raises(RequestError, match="context"):
        engine.add_request("y", [1] * engine.max_model_len, GREEDY)
    with pytest.raises(RequestError, match="max_tokens"):
        engine.add_request("z", [1, 2], SamplingParams(max_tokens=engine.max_model_len))
    with pytest.raises(RequestError, match="logit_bias"):
        engine.add_request("w", "hi", SamplingParams(logit_bias={10**7: 1.0}))
    assert not engine.has_unfinished()


def test_a_failing_step_fails_only_its_requests(loaded):
    engine = make_engine(loaded)
    engine.add_request("ok-before", "Hello there", GREEDY)
    engine.step()  # ok-before is prefilled and decoding

    def explode(sched):
        if any(s.request.request_id == "bad" for s in sched.scheduled):
            raise RuntimeError("injected")

    engine.fault_hook = explode
    engine.add_request("bad", "This request meets a broken step", GREEDY)
    deltas, _, finished = engine.step()
    failed = {d.request_id: d for d in deltas}
    assert failed["bad"].finish_reason == "error" and "internal error" in failed["bad"].error
    assert failed["ok-before"].finish_reason == "error"  # it shared the broken step
    assert {r.finish_reason for r in finished} == {"error"}
    engine.fault_hook = None
    tokens, _, _ = run(engine, ["After the fault"])
    assert len(tokens["0"]) == GREEDY.max_tokens  # the engine keeps serving
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_native_packed_layers_match_the_modular_path(loaded, dtype):
    """With the GGUF's packed weights each decoder layer runs as two native calls around its
    attention layer (engine/csrc/decoder_layer.cpp).  They run the modular path's kernels in its
    order, so a mixed batch (decodes, a 100-token prompt above the small-batch row limit, prompts
    chunked by the token budget) gives the same tokens and the same log-probabilities, to the
    bit, with the native path on and off.  (bf16 sends batches of 5-19 rows to the packed kernel
    with int8 activations and larger ones to the row-int8 copies; float32 sends them to the dense
    matmul, i.e. the modular path.)"""
    model = loaded if dtype == "float32" else load_model("default", torch.bfloat16)
    cfg = EngineConfig(
        model="default",
        dtype=dtype,
        cache=CacheConfig(num_blocks=256, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_batched_tokens=96, max_num_seqs=8),
    )
    engine = LLMEngine(cfg, loaded=model)
    layers = engine.runner.model.layers
    assert all(layer.packed is not None for layer in layers)
    prompts = PROMPTS[:4] + [" ".join(["word"] * 100)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)

    def generate() -> dict:
        out = {}
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        while engine.has_unfinished():
            for d in engine.step()[0]:
                out.setdefault(d.request_id, []).extend((lp.token_id, lp.logprob, tuple(lp.top)) for lp in d.new_logprobs)
        return out

    native = generate()
    saved = [(layer.packed, layer.packed_max_rows) for layer in layers]
    for layer in layers:
        layer.packed = None
    modular = generate()
    for layer, (packed, rows) in zip(layers, saved):
        layer.packed, layer.packed_max_rows = packed, rows
    assert native == modular
    assert all(len(v) == 8 for v in native.values()) and len(native) == len(prompts)
