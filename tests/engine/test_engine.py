"""Engine behaviour a user would notice, on the real default model in float32.

Batch invariance, chunked prefill, preemption, prefix caching, n > 1, aborts and
no leaked KV blocks.
"""

from __future__ import annotations

import ctypes
import os

import pytest
import torch

from engine.attention.backends.cpu import _get_attn_isa
from engine.attention import dispatch
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.loader import load_model
from engine.request import SamplingParams
from engine.validation import RequestError
from tests.engine.native_layers import native_and_modular

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


def _whole_pages(t: torch.Tensor) -> tuple[int, int]:
    """(address, length) of the memory pages lying wholly inside a contiguous tensor."""
    page = os.sysconf("SC_PAGE_SIZE")
    start = -(-t.data_ptr() // page) * page
    end = (t.data_ptr() + t.numel() * t.element_size()) // page * page
    return start, max(0, end - start)


def resident_fraction(t: torch.Tensor) -> float:
    """Share of the tensor's pages that are resident in memory (mincore)."""
    start, length = _whole_pages(t)
    vec = (ctypes.c_ubyte * (length // os.sysconf("SC_PAGE_SIZE")))()
    assert LIBC.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec) / len(vec)


def drop_pages(t: torch.Tensor) -> None:
    """Hand the tensor's pages back to the kernel (MADV_DONTNEED): not resident until touched again."""
    start, length = _whole_pages(t)
    assert LIBC.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), 4) == 0, ctypes.get_errno()


LIBC = ctypes.CDLL(None, use_errno=True)


def make_engine(loaded, num_blocks=512, max_batched=2048, max_seqs=64, prefix=True, dtype="float32", kv="auto") -> LLMEngine:
    cfg = EngineConfig(
        model="default",
        dtype=dtype,
        weight_quant="none",
        cache=CacheConfig(num_blocks=num_blocks, enable_prefix_caching=prefix, kv_cache_dtype=kv),
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


def test_prefix_cache_reserve_bounds_the_resident_cache(loaded):
    """Freed blocks are reused once the prefix-cache reserve is full, so one request at a time keeps
    the same few blocks resident; the default reserve is 1/32 of the pool, at least one context,
    and can be made resident up front."""

    def engine(**cache) -> LLMEngine:
        cfg = EngineConfig(model="default", dtype="float32", weight_quant="none",
                           cache=CacheConfig(num_blocks=2048, **cache), scheduler=SchedulerConfig(max_model_len=256))
        return LLMEngine(cfg, loaded=loaded)

    default = engine()
    assert default.kv.reserve_blocks == 64  # 2048 / 32 blocks, above one 256-token context's 16
    for cache in default.runner.kv_caches:  # what a fresh process has: untouched memory
        drop_pages(cache)
    assert max(resident_fraction(c[:64]) for c in default.runner.kv_caches) == 0.0
    assert default.prefault_kv_cache() == 64 and default.kv.num_resident_blocks == 64  # the warm-up calls it
    assert min(resident_fraction(c[:64]) for c in default.runner.kv_caches) == 1.0
    assert engine(prefix_cache_gb=100.0).kv.pool.reserve == 2048
    tight = engine(prefix_cache_gb=0.0)
    outputs = [run(tight, [p])[0]["0"] for p in PROMPTS[:6]]
    per_request = max(-(-(len(tight.tokenizer.encode(p)) + GREEDY.max_tokens) // 16) for p in PROMPTS[:6])
    assert tight.kv.num_resident_blocks <= per_request
    assert outputs == [run(make_engine(loaded), [p])[0]["0"] for p in PROMPTS[:6]]


def test_prefix_cache_reserve_is_capped_in_bytes(loaded, caplog):
    """One full context of a long-context model is more than a cache of recent prefixes needs, and
    the server makes the reserve resident at start-up: by default it stops at PREFIX_CACHE_MAX_GB,
    and the start-up log gives it in blocks, tokens and MiB; an explicit --prefix-cache-gb still wins."""
    from engine.config import PREFIX_CACHE_MAX_GB

    def engine(max_model_len: int, **cache) -> LLMEngine:
        cfg = EngineConfig(model="default", dtype="float32", weight_quant="none",
                           cache=CacheConfig(num_blocks=1024, **cache), scheduler=SchedulerConfig(max_model_len=max_model_len))
        return LLMEngine(cfg, loaded=loaded)

    with caplog.at_level("INFO", logger="engine.engine"):
        long_context = engine(8192)  # one context: 512 blocks of 737 KiB (float32 KV), 368 MiB
    cap = int(PREFIX_CACHE_MAX_GB * 2**30) // long_context.kv_block_bytes
    assert 8192 // 16 > cap == long_context.kv.reserve_blocks
    assert long_context.kv.reserve_blocks * long_context.kv_block_bytes <= PREFIX_CACHE_MAX_GB * 2**30
    ready = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("engine ready"))
    mib = cap * long_context.kv_block_bytes / 2**20
    assert f"cached prefixes keep up to {cap} freed blocks = {cap * 16} tokens, {mib:.0f} MiB" in ready
    assert engine(256).kv.reserve_blocks == 32  # 1/32 of the pool, above one context's 16, below the cap
    assert engine(8192, prefix_cache_gb=0.5).kv.reserve_blocks > cap


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
    assert not engine.scheduler.requests and not engine.output.text_states


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
    bit, with the native path on and off.  (bf16 sends batches from 5 rows up to the row-int8
    switch timed at load to the packed kernel with int8 activations and larger ones to the row-int8
    copies; float32 sends them to the dense matmul, i.e. the modular path.)"""
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
    assert engine.runner.model.packed_body is not None  # the model's loop over the bound native calls
    native, modular = native_and_modular(engine, prompts, params)
    assert native == modular
    assert all(len(v) == 8 for v in native.values()) and len(native) == len(prompts)


def test_last_layer_runs_only_the_rows_that_need_logits(loaded):
    """A prompt chunk needs every layer's K/V for the tokens after it but logits from at most its
    last token: given the rows it wants, the model's last layer runs its o projection and MLP on
    those alone, and given none it stops after its attention.  The rows asked for come back as the
    full forward computes them, in the order asked, and every layer's cache holds the same K/V
    either way."""
    from engine.forward_context import ForwardContext, set_forward_context

    engine = make_engine(loaded, prefix=False)
    engine.add_request("p", list(range(1000, 1040)), GREEDY)
    ids, positions, meta, _ = engine.runner._prepare(engine.scheduler.schedule())
    model = engine.runner.model
    caches = [layer.kv_cache for layer in model.attention_layers()]

    def forward(out_rows):
        for c in caches:
            c.zero_()
        with torch.inference_mode(), set_forward_context(ForwardContext(meta)):
            hidden = model(ids, positions, out_rows)
        return hidden, [c.clone() for c in caches]

    full, full_caches = forward(None)
    assert full.shape[0] == 40 and all(torch.count_nonzero(c) > 0 for c in full_caches)
    rows = torch.tensor([39, 5, 17])
    some, some_caches = forward(rows)
    torch.testing.assert_close(some, full[rows], rtol=1e-5, atol=1e-5)
    none, none_caches = forward(torch.tensor([], dtype=torch.long))
    assert none.shape == (0, full.shape[1])
    for a, b, c in zip(full_caches, some_caches, none_caches):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_kv_cache_auto_is_int8_where_decode_multiplies_it_as_int8(loaded):
    """``auto`` stores int8 for bfloat16 runs on CPUs whose decode attention multiplies int8 rows
    directly (AVX-512 VNNI), else the run's dtype; int8 rows take 136 bytes against bf16's 256, so
    the same memory holds ~1.9x the tokens.  A bf16 cache under a float32 run is refused."""
    bf16 = load_model("default", torch.bfloat16)

    def engine(kv: str) -> LLMEngine:
        cfg = EngineConfig(
            model="default",
            cache=CacheConfig(kv_cache_gb=0.05, kv_cache_dtype=kv),
            scheduler=SchedulerConfig(max_model_len=1024),
        )
        return LLMEngine(cfg, loaded=bf16)

    isa = _get_attn_isa(torch.bfloat16, 16, bf16.config.head_dim, "int8")
    mine = CacheConfig()
    auto = LLMEngine(EngineConfig(model="default", cache=mine), loaded=bf16)
    assert auto.config.cache.kv_cache_dtype == ("int8" if dispatch.int8_decode_path(isa) else "bfloat16")
    assert mine.kv_cache_dtype == "auto"  # resolved on a copy: the caller's config is not changed
    assert make_engine(loaded, num_blocks=8).config.cache.kv_cache_dtype == "float32"
    blocks = {kv: engine(kv).runner.num_blocks for kv in ("int8", "bfloat16")}
    assert 1.85 < blocks["int8"] / blocks["bfloat16"] < 1.9
    with pytest.raises(ValueError, match="kv_cache_dtype bfloat16 needs dtype bfloat16"):
        EngineConfig(dtype="float32", cache=CacheConfig(kv_cache_dtype="bfloat16"))


def test_int8_kv_cache_is_batch_invariant():
    """The int8 cache's decode path works per request and kv head, so a prompt's greedy tokens do
    not depend on what it is batched with (or on chunked prefill)."""
    bf16 = load_model("default", torch.bfloat16)
    engine = make_engine(bf16, dtype="bfloat16", kv="int8")
    alone = run(engine, PROMPTS[:1])[0]["0"]
    assert run(engine, PROMPTS)[0]["0"] == alone
    chunked = make_engine(bf16, dtype="bfloat16", kv="int8", max_batched=8)
    assert run(chunked, PROMPTS[:4])[0]["0"] == alone


def test_batch_layout_of_a_mixed_step():
    """The model runner's batch for decodes, a prompt chunk after cached context and a fresh prompt
    asking for prompt logprobs: token ids, positions, KV slots (block_id * block_size + offset),
    query starts, context lengths, padded block table, and the rows whose logits are needed."""
    from engine.model_runner import ModelRunner
    from engine.scheduler import ScheduledRequest, SchedulerOutput
    from engine.request import Request

    def request(rid: str, prompt: list[int], outputs: list[int], computed: int, **params) -> Request:
        r = Request(rid, prompt, SamplingParams(max_tokens=50, **params))
        for t in outputs:
            r.append_token(t)
        r.num_computed_tokens = computed
        return r

    d1 = request("d1", list(range(100, 130)), list(range(200, 208)), 37)  # decodes position 37
    d2 = request("d2", list(range(300, 310)), list(range(400, 406)), 15)  # position 15: last slot of block 0
    chunk = request("c", list(range(500, 540)), [], 16)  # prompt positions 16..23 of 40
    fresh = request("p", [7, 8, 9], [], 0, prompt_logprobs=1)
    out = SchedulerOutput(
        [ScheduledRequest(d1, 1, [7, 3, 9]), ScheduledRequest(d2, 1, [4]),
         ScheduledRequest(chunk, 8, [2, 5]), ScheduledRequest(fresh, 3, [8])],
        total_num_tokens=13, num_prefill_tokens=11, num_decode_tokens=2,
    )
    runner = ModelRunner.__new__(ModelRunner)
    runner.block_size = 16
    ids, positions, meta, logit_rows = runner._prepare(out)
    assert ids.tolist() == [207, 405, *range(516, 524), 7, 8, 9]
    assert positions.tolist() == [37, 15, *range(16, 24), 0, 1, 2]
    assert meta.slot_mapping.tolist() == [9 * 16 + 5, 4 * 16 + 15, *range(5 * 16, 5 * 16 + 8), 128, 129, 130]
    assert meta.query_start_loc.tolist() == meta.query_start_loc_list == [0, 1, 2, 10, 13]
    assert meta.seq_lens.tolist() == meta.seq_lens_list == [38, 16, 24, 3]
    assert meta.block_table.tolist() == [[7, 3, 9], [4, 0, 0], [2, 5, 0], [8, 0, 0]]
    assert (meta.num_decodes, meta.max_query_len, meta.max_seq_len, meta.num_actual_tokens) == (2, 8, 38, 13)
    assert logit_rows == [0, 1, 10, 11, 12]  # the decodes sample; the chunk does not; all of p's rows


def test_greedy_tokens_come_straight_from_the_lm_head():
    """On the default configuration (packed weights, bf16), a step whose rows all decode plain
    greedy asks the LM head for the tokens instead of the logits (Linear.argmax, on the packed
    blocks or the row-int8 copy as the batch's size routes it), and the tokens are the ones the
    logits give; a request that wants logprobs sends its step through the logits and the sampler."""
    engine = LLMEngine(EngineConfig(cache=CacheConfig(num_blocks=256, enable_prefix_caching=False)))
    model = engine.runner.model
    if model.lm_head.packed is None:
        pytest.skip("no packed LM head on this configuration")
    fused = model.greedy_tokens
    answered = []

    def counting(hidden):
        ids = fused(hidden)
        answered.append(ids is not None)
        return ids

    model.greedy_tokens = counting
    tokens, _, _ = run(engine, PROMPTS)
    assert answered and all(answered)  # every step, whatever its batch size
    model.greedy_tokens = lambda hidden: None  # every step through the logits
    assert run(engine, PROMPTS)[0] == tokens

    model.greedy_tokens = counting
    answered.clear()
    want_logprobs = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"lp{i}", p, want_logprobs if i == 0 else GREEDY)
    got: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for d in engine.step()[0]:
            got.setdefault(d.request_id, []).extend(d.new_token_ids)
    assert not answered  # a row wanted logprobs in every step
    assert [got[f"lp{i}"] for i in range(len(PROMPTS))] == [tokens[str(i)] for i in range(len(PROMPTS))]
