"""The on-disk cache of packed layouts (engine/quant/pack_cache.py): a second start-up maps what the
first packed, bit for bit, and generates the same tokens; a changed file misses; a cache folder
that cannot be written costs a warning, not the start-up."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.layers.linear import Linear
from engine.quant import pack_cache
from engine.quant.weights import PackedParts, native_available
from engine.request import SamplingParams
from tests.tiny_models import make_tiny_gguf, make_tiny_hf_model

pytestmark = pytest.mark.skipif(not native_available(), reason="no native extension")
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(autouse=True)
def small_cache(monkeypatch, tmp_path):
    """Cache the tiny models too, in this test's own folder."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("CPUSERVE_ROWS_INT8_MIN_ROWS", "16")
    monkeypatch.setattr(pack_cache, "MIN_BYTES", 0)


def build(path: str, caplog, **kwargs) -> tuple[LLMEngine, list[str]]:  # noqa: ANN001
    caplog.clear()
    cfg = EngineConfig(model=path, cache=CacheConfig(num_blocks=64), scheduler=SchedulerConfig(max_model_len=256), **kwargs)
    with caplog.at_level(logging.INFO, logger="engine.quant.attach"):
        engine = LLMEngine(cfg)
    return engine, [r.getMessage() for r in caplog.records]


def packed_bytes(engine: LLMEngine) -> dict[str, bytes]:
    out = {}
    for name, m in engine.runner.model.named_modules():
        if isinstance(m, Linear) and m.packed is not None:
            parts = m.packed.parts if isinstance(m.packed, PackedParts) else [m.packed]
            out[name] = b"".join(p.data.numpy().tobytes() for p in parts)
    return out


def tokens(engine: LLMEngine) -> list[int]:
    engine.add_request("r", [5, 17, 33, 90], GREEDY)
    got: list[int] = []
    while engine.has_unfinished():
        for d in engine.step()[0]:
            got.extend(d.new_token_ids)
    return got


@pytest.mark.parametrize("qtype", ["Q4_K_M", "Q4_0"])
def test_second_start_maps_the_first_ones_packing(tmp_path, caplog, qtype):
    path = str(make_tiny_gguf(tmp_path, "llama", qtype))
    first, log1 = build(path, caplog)
    assert any("packed weights cached in" in line for line in log1), log1
    second, log2 = build(path, caplog)
    assert any("mapped from the cache" in line for line in log2), log2
    assert packed_bytes(first) and packed_bytes(second) == packed_bytes(first)
    assert tokens(second) == tokens(first)

    os.utime(path, ns=(0, os.stat(path).st_mtime_ns + 10**9))  # an edited file: repacked, cached anew
    third, log3 = build(path, caplog)
    assert not any("mapped from the cache" in line for line in log3)
    assert any("packed weights cached in" in line for line in log3)
    assert packed_bytes(third) == packed_bytes(first)


def test_weights_quantized_at_load_are_cached_per_type(tmp_path, caplog):
    """--weight-quant on a Hugging Face directory: the second start maps the first one's quantized
    weights (the same bytes, the same tokens); another type, or a changed file, is not served from it."""
    path = str(make_tiny_hf_model(tmp_path, "llama", seed=2))
    first, log1 = build(path, caplog, weight_quant="q4_0")
    assert any("packed weights cached in" in line for line in log1), log1
    second, log2 = build(path, caplog, weight_quant="q4_0")
    assert any("mapped from the cache" in line for line in log2), log2
    assert packed_bytes(first) and packed_bytes(second) == packed_bytes(first)
    assert tokens(second) == tokens(first)

    other, log3 = build(path, caplog, weight_quant="q8_0")
    assert not any("mapped from the cache" in line for line in log3)
    assert {m.packed.qtype for m in other.runner.model.modules() if isinstance(m, Linear)} == {"Q8_0"}

    weights = os.path.join(path, "model.safetensors")
    os.utime(weights, ns=(0, os.stat(weights).st_mtime_ns + 10**9))
    _, log4 = build(path, caplog, weight_quant="q4_0")
    assert not any("mapped from the cache" in line for line in log4)


def test_an_unwritable_cache_folder_only_warns(tmp_path, caplog, monkeypatch):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    path = str(make_tiny_gguf(tmp_path, "llama", "Q4_0"))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="engine.quant.pack_cache"):
        engine, _ = build(path, caplog)
    assert any("could not cache the packed weights" in r.getMessage() for r in caplog.records)
    assert tokens(engine)


def test_small_models_are_not_cached(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(pack_cache, "MIN_BYTES", 64 << 20)
    path = str(make_tiny_gguf(tmp_path, "llama", "Q4_0"))
    _, log = build(path, caplog)
    assert not any("cached" in line for line in log)
    assert not os.path.exists(tmp_path / "xdg" / "cpuserve")
