"""The attention contract: on every layer, do_kv_cache_update runs before forward and writes exactly the step's slots.

Also the layer's guards (KV sharing, missing key/value, encoder-only) and the cache
layout (one tensor per layer, key/value as views).
"""

from __future__ import annotations

import pytest
import torch

from engine.attention.backends.cpu import CPUAttentionBackend, CPUAttentionBackendImpl
from engine.attention.metadata import CPUAttentionMetadata
from engine.attention.layer import Attention, AttentionType
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.forward_context import ForwardContext, set_forward_context
from engine.kv_cache.layout import split_kv_cache
from engine.request import SamplingParams
from tests.tiny_models import make_tiny_hf_model


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), "llama", seed=3)
    cfg = EngineConfig(
        model=str(path),
        dtype="float32",
        cache=CacheConfig(num_blocks=32, block_size=16),
        scheduler=SchedulerConfig(max_num_batched_tokens=24),
    )
    return LLMEngine(cfg)


def test_backend_declares_separate_update_and_cache_layout(engine):
    assert CPUAttentionBackend.forward_includes_kv_cache_update is False
    cfg = engine.model_config
    for cache in engine.runner.kv_caches:
        assert cache.shape == (32, cfg.num_key_value_heads, 16, 2 * cfg.head_dim)
    k, v = split_kv_cache(engine.runner.kv_caches[0], cfg.head_dim)
    assert k.data_ptr() == engine.runner.kv_caches[0].data_ptr()  # views, not copies
    assert v.untyped_storage().data_ptr() == engine.runner.kv_caches[0].untyped_storage().data_ptr()


def test_update_before_forward_on_every_layer_writing_exactly_the_slots(engine, monkeypatch):
    calls: list[tuple[str, str]] = []
    writes: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    orig_update = CPUAttentionBackendImpl.do_kv_cache_update
    orig_forward = CPUAttentionBackendImpl.forward

    def update(self, layer, key, value, kv_cache, slot_mapping):
        calls.append((layer.layer_name, "update"))
        before = kv_cache.clone()
        orig_update(self, layer, key, value, kv_cache, slot_mapping)
        writes.append((layer.layer_name, before, slot_mapping.clone()))

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output):
        calls.append((layer.layer_name, "forward"))
        # the step's new keys are already in the cache when forward runs
        head = layer.head_size
        blocks, offs = attn_metadata.slot_mapping // 16, attn_metadata.slot_mapping % 16
        torch.testing.assert_close(kv_cache[blocks, :, offs, :head], key)
        return orig_forward(self, layer, query, key, value, kv_cache, attn_metadata, output)

    monkeypatch.setattr(CPUAttentionBackendImpl, "do_kv_cache_update", update)
    monkeypatch.setattr(CPUAttentionBackendImpl, "forward", forward)
    for cache in engine.runner.kv_caches:
        cache.fill_(float("nan"))
    # a prompt of 40 tokens under a 24-token budget: a fresh chunk, then a chunk after cached context
    engine.add_request("a", list(range(5, 45)), SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    engine.step()
    layers = [layer.layer_name for layer in engine.runner.model.attention_layers()]
    assert calls == [(name, kind) for name in layers for kind in ("update", "forward")]
    for name, before, slots in writes:
        cache = engine.runner.kv_caches[layers.index(name)]
        assert slots.tolist() == list(range(24))  # blocks 0 and 1: first block, then 8 slots of the second
        changed = ~(torch.isnan(before) == torch.isnan(cache)) | (before.nan_to_num() != cache.nan_to_num())
        changed_slots = changed.any(dim=-1).any(dim=1)  # [num_blocks, block_size]
        expected = torch.zeros_like(changed_slots)
        expected.view(-1)[:24] = True
        assert torch.equal(changed_slots, expected)
    while engine.has_unfinished():
        engine.step()


def _meta(slots: list[int]) -> CPUAttentionMetadata:
    n = len(slots)
    return CPUAttentionMetadata(
        num_actual_tokens=n,
        num_decodes=0,
        num_decode_tokens=0,
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_table=torch.tensor([[0]], dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=n,
        max_seq_len=n,
    )


def _layer(**kw) -> Attention:
    layer = Attention(2, 8, 8**-0.5, 1, layer_name="l", block_size=8, model_dtype=torch.float32, **kw)
    layer.kv_cache = torch.zeros(2, 1, 8, 16)
    return layer


@pytest.mark.parametrize(
    "kwargs, key_value",
    [
        ({"kv_sharing_target_layer_name": "other"}, True),
        ({"attn_type": AttentionType.ENCODER_ONLY}, True),
        ({}, False),
    ],
)
def test_layer_guards_skip_the_cache_update(monkeypatch, kwargs, key_value):
    layer = _layer(**kwargs)
    updates = []
    monkeypatch.setattr(layer.impl, "do_kv_cache_update", lambda *a: updates.append(a))
    monkeypatch.setattr(layer.impl, "forward", lambda *a: a[-1])
    q = torch.randn(3, 16)
    k = torch.randn(3, 8) if key_value else None
    v = torch.randn(3, 8) if key_value else None
    with set_forward_context(ForwardContext(_meta([0, 1, 2]))):
        layer(q, k, v)
    assert updates == []


def test_per_head_inputs_with_an_output_buffer_match_the_flat_call():
    """The native decoder layer hands the attention layer per-head views and a buffer to write: the
    cache gets the same writes and the buffer the same rows as the flat [T, H*D] call returns."""
    q, k, v = torch.randn(3, 16), torch.randn(3, 8), torch.randn(3, 8)
    flat_layer, head_layer = _layer(), _layer()
    with set_forward_context(ForwardContext(_meta([0, 1, 2]))):
        flat = flat_layer(q, k, v)
        buffer = torch.full((3, 2, 8), float("nan"))
        got = head_layer(q.view(3, 2, 8), k.view(3, 1, 8), v.view(3, 1, 8), buffer)
    assert got is buffer
    torch.testing.assert_close(buffer.view(3, 16), flat)
    torch.testing.assert_close(head_layer.kv_cache, flat_layer.kv_cache)
    assert torch.count_nonzero(head_layer.kv_cache) > 0


def test_padding_slots_are_skipped():
    layer = _layer()
    q, k, v = torch.randn(3, 16), torch.randn(3, 8), torch.randn(3, 8)
    with set_forward_context(ForwardContext(_meta([3, -1, 9]))):
        layer.impl.do_kv_cache_update(layer, k.view(3, 1, 8), v.view(3, 1, 8), layer.kv_cache, torch.tensor([3, -1, 9]))
    written = (layer.kv_cache != 0).any(-1)[:, 0].view(-1).nonzero().view(-1).tolist()
    assert written == [3, 9]


def test_encoder_only_attends_without_the_cache():
    layer = _layer(attn_type=AttentionType.ENCODER_ONLY)
    q, k, v = torch.randn(4, 16), torch.randn(4, 8), torch.randn(4, 8)
    with set_forward_context(ForwardContext(_meta([0, 1, 2, 3]))):
        out = layer(q, k, v)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.view(4, 2, 8).transpose(0, 1), k.view(4, 1, 8).transpose(0, 1), v.view(4, 1, 8).transpose(0, 1),
        enable_gqa=True,
    ).transpose(0, 1).reshape(4, 16)
    torch.testing.assert_close(out, ref)
    assert torch.count_nonzero(layer.kv_cache) == 0


def test_a_native_kernel_that_fails_its_self_check_is_not_selected(monkeypatch):
    from engine.attention import dispatch

    isas = dispatch.available_isas()
    if not isas:
        pytest.skip("no native attention kernels on this host")
    best = dispatch.select_isa(torch.bfloat16, 16, 64, "auto")
    assert best in isas and dispatch.self_check(best, torch.bfloat16, 16, 64, "auto")
    dispatch.self_check.cache_clear()
    original = dispatch.paged_attention

    def broken(isa, query, kv_cache, meta, scale, kv_cache_dtype, k_scale, v_scale, output):
        original(isa, query, kv_cache, meta, scale, kv_cache_dtype, k_scale, v_scale, output)
        if isa == best:
            output.mul_(1.5)  # a miscompiled or misbehaving path

    monkeypatch.setattr(dispatch, "paged_attention", broken)
    try:
        fallback = dispatch.select_isa(torch.bfloat16, 16, 64, "auto")
        assert fallback != best
    finally:
        dispatch.self_check.cache_clear()
