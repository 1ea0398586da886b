"""What a GGUF model costs in memory: no dense copy of what the packed kernels serve, a token
embedding looked up from its blocks, and row-int8 copies only within their budget.

The engine's figures a user sees are its idle RSS and the start-up log; these tests pin the
mechanisms behind them (and that the tokens do not change).
"""

from __future__ import annotations

import logging

import pytest
import torch

from engine import engine as engine_module
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.quant import routing, weights as qweights
from engine.layers.embedding import BlockEmbedding
from engine.layers.linear import Linear
from engine.loader import load_model
from engine.request import SamplingParams
from tests.tiny_models import make_tiny_gguf

needs_native = pytest.mark.skipif(not qweights.native_available(), reason="no native extension")
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 17, 33, 90], [200, 3, 3, 41, 7, 120, 64], [11]]


@pytest.fixture(autouse=True)
def pinned_rows_int8_switch(monkeypatch):
    """Skip timing the row-int8 switch at each engine build (a second of a busy host's time each;
    the switch does not matter here)."""
    monkeypatch.setenv("CPUSERVE_ROWS_INT8_MIN_ROWS", "16")


def tiny_engine(path: str, loaded=None, **kwargs) -> LLMEngine:  # noqa: ANN001
    cfg = EngineConfig(model=path, cache=CacheConfig(num_blocks=64), scheduler=SchedulerConfig(max_model_len=256), **kwargs)
    return LLMEngine(cfg, loaded=loaded)


def greedy_tokens(engine: LLMEngine) -> list[list[int]]:
    out = []
    for i, ids in enumerate(PROMPTS):
        engine.add_request(str(i), ids, GREEDY)
        tokens: list[int] = []
        while engine.has_unfinished():
            for d in engine.step()[0]:
                tokens.extend(d.new_token_ids)
        out.append(tokens)
    return out


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_embedding_rows_equal_the_dense_table(tmp_path, qtype, dtype):
    """Rows dequantized from the blocks on lookup are exactly the loader's dense table's rows, from
    a mapping of the embedding's own bytes (not the loader's whole-file map)."""
    loaded = load_model(str(make_tiny_gguf(tmp_path, "llama", qtype)), dtype)
    name = "model.embed_tokens.weight"
    emb = BlockEmbedding.from_gguf(loaded.gguf_tensors[name], loaded.source, dtype)
    ids = torch.tensor([0, 5, 5, emb.num_embeddings - 1, 17])
    assert torch.equal(emb(ids), loaded.weights[name][ids])
    assert emb(ids).dtype == dtype
    assert emb.blocks.data_ptr() != loaded.gguf_tensors[name].data.data_ptr()


def test_loader_skips_the_dense_copies_it_is_told_to(tmp_path):
    """``skip_dense`` leaves those weights out of ``weights`` (raw blocks only); the rest load as before.
    Un-permuted llama q/k rows are copies, everything else a view of the file at its offset."""
    path = str(make_tiny_gguf(tmp_path, "llama", "Q8_0"))
    full = load_model(path, torch.float32)
    seen = {}

    def skip(cfg, raw):  # noqa: ANN001, ANN202
        seen.update(raw)
        return {n for n in raw if ".mlp." in n}

    part = load_model(path, torch.float32, skip_dense=skip)
    assert set(seen) == set(full.gguf_tensors)
    assert set(part.weights) == {n for n in full.weights if ".mlp." not in n}
    for name, w in part.weights.items():
        assert torch.equal(w, full.weights[name]), name
    offsets = {n: t.file_offset for n, t in part.gguf_tensors.items()}
    assert offsets["model.layers.0.self_attn.q_proj.weight"] is None
    assert offsets["model.layers.0.self_attn.k_proj.weight"] is None
    assert offsets["model.layers.0.self_attn.v_proj.weight"] is not None
    raw = open(path, "rb").read()
    emb = part.gguf_tensors["model.embed_tokens.weight"]
    assert raw[emb.file_offset : emb.file_offset + emb.data.numel()] == emb.data.numpy().tobytes()


@needs_native
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # tied embedding / separate LM head with q/k/v biases
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_engine_keeps_no_dense_copy_of_packed_weights(tmp_path, monkeypatch, arch, qtype):
    """A bfloat16 engine on a GGUF file never dequantizes the weights its packed kernels serve: the
    loader hands over no dense matrix at all, every projection's dense weight is empty, the
    embedding is looked up from its blocks; and it generates the same tokens as an engine built
    from a fully dense load."""
    path = str(make_tiny_gguf(tmp_path, arch, qtype))
    loads, real_load = [], engine_module.load_model

    def spy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        loads.append(real_load(*args, **kwargs))
        return loads[-1]

    monkeypatch.setattr(engine_module, "load_model", spy)
    lean = tiny_engine(path)
    monkeypatch.setattr(engine_module, "load_model", real_load)
    assert [n for n, w in loads[0].weights.items() if w.dim() == 2] == []
    model = lean.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert all(m.packed is not None and m.weight.numel() == 0 for m in linears)
    assert isinstance(model.embed_tokens, BlockEmbedding)
    if arch == "qwen2":
        assert model.layers[0].self_attn.qkv_proj.bias.numel() > 0  # biases stay dense

    dense = tiny_engine(path, loaded=load_model(path, torch.bfloat16))
    assert isinstance(dense.runner.model.embed_tokens, torch.nn.Embedding)
    ids = torch.arange(0, lean.model_config.vocab_size, 7)
    assert torch.equal(model.embed_tokens(ids), dense.runner.model.embed_tokens(ids))
    assert greedy_tokens(lean) == greedy_tokens(dense)


@needs_native
def test_weight_quant_none_and_dense_large_batches_keep_dense_weights(tmp_path):
    """Where a dense matmul may run (weight_quant none; float32 runs' large batches), every weight
    loads dense (as it is, or repacked for the native bf16 kernel) and the embedding stays a plain table."""
    path = str(make_tiny_gguf(tmp_path, "qwen2", "Q8_0"))
    for kwargs in ({"weight_quant": "none"}, {"dtype": "float32"}):
        model = tiny_engine(path, **kwargs).runner.model
        linears = [m for m in model.modules() if isinstance(m, Linear)]
        assert all(m.weight.numel() > 0 or m.dense_packed is not None for m in linears), kwargs
        if "dtype" in kwargs:
            assert all(m.weight.numel() > 0 for m in linears)
    # float32: projections dense for large batches, but the untied embedding is still served from blocks
    assert isinstance(tiny_engine(path, dtype="float32").runner.model.embed_tokens, BlockEmbedding)
    assert isinstance(tiny_engine(path, weight_quant="none").runner.model.embed_tokens, torch.nn.Embedding)


def test_rows_int8_decision_says_why():
    mib = 2**20
    assert routing.rows_int8_decision(129 * mib, 256 * mib) == (True, "on (129 MiB, within the 256 MiB budget of --rows-int8-budget-gb)")
    on, why = routing.rows_int8_decision(929 * mib, 256 * mib)
    assert not on and why.startswith("off: they would take 929 MiB, over the 256 MiB budget")
    assert routing.rows_int8_decision(929 * mib, None) == (True, "on (929 MiB): --large-batch-matmul int8_rows")


@needs_native
@pytest.mark.skipif(not qweights.rows_int8_fast(), reason="row-int8 copies need AVX-512 VNNI or AMX")
def test_row_int8_copies_fit_their_budget(caplog):
    """The default model's copies (129 MiB) fit the default budget; under a smaller one they are not
    made, and the start-up log says so with their size; int8_rows makes them whatever the budget."""

    def build(**kwargs) -> tuple[LLMEngine, list[str]]:  # noqa: ANN003
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="engine.quant.attach"):
            eng = LLMEngine(EngineConfig(model="default", cache=CacheConfig(num_blocks=16), **kwargs))
        return eng, [r.getMessage() for r in caplog.records if "row-int8 weight copies" in r.getMessage()]

    def copies(eng: LLMEngine) -> list:
        return [m.rows_int8 for m in eng.runner.model.modules() if isinstance(m, Linear) and m.packed is not None]

    eng, lines = build()
    made = copies(eng)
    assert all(c is not None for c in made)
    size = sum(c.nbytes for c in made)
    assert routing.rows_int8_bytes(eng.runner.model) == size
    assert lines == [f"row-int8 weight copies for large batches: {routing.rows_int8_decision(size, 2**28)[1]}"]
    assert "within the 256 MiB budget" in lines[0]

    eng, lines = build(rows_int8_budget_gb=0.01)
    assert all(c is None for c in copies(eng))
    assert lines == [f"row-int8 weight copies for large batches: off: they would take {size / 2**20:.0f} MiB, over "
                     "the 10 MiB budget of --rows-int8-budget-gb (raise it, or --large-batch-matmul int8_rows, to make them)"]

    eng, lines = build(rows_int8_budget_gb=0.0, large_batch_matmul="int8_rows")
    assert all(c is not None for c in copies(eng))
    assert lines == [f"row-int8 weight copies for large batches: on ({size / 2**20:.0f} MiB): --large-batch-matmul int8_rows"]
