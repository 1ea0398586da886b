"""Numerical parity with Hugging Face transformers (a test-only reference), in float32.

For tiny random Llama and Qwen2 checkpoints and for the real SmolLM2 GGUF: next-token
logits match within 1e-3 at prefill and at every decode step, and greedy continuations
match token for token.  The GGUF case also proves the Q/K un-permutation.
"""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import CacheConfig, EngineConfig
from engine.engine import LLMEngine
from engine.request import SamplingParams
from tests.tiny_models import make_tiny_hf_model, smollm2_gguf_path

ATOL = 1e-3
STEPS = 8


def engine_logits(engine: LLMEngine, prompt_ids: list[int], steps: int) -> tuple[list[torch.Tensor], list[int]]:
    """Greedy-decode ``steps`` tokens; return the logits row behind every sampled token and the tokens."""
    captured: list[torch.Tensor] = []
    model = engine.runner.model
    original = model.compute_logits

    def capture(hidden: torch.Tensor) -> torch.Tensor:
        out = original(hidden)
        captured.append(out[-1].clone())
        return out

    model.compute_logits = capture  # type: ignore[method-assign]
    try:
        engine.add_request("p", prompt_ids, SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True))
        tokens: list[int] = []
        while engine.has_unfinished():
            deltas, _, _ = engine.step()
            for d in deltas:
                tokens.extend(d.new_token_ids)
    finally:
        model.compute_logits = original  # type: ignore[method-assign]
    return captured, tokens


def check_parity(engine: LLMEngine, hf_model: torch.nn.Module, prompt_ids: list[int]) -> None:
    logits, tokens = engine_logits(engine, prompt_ids, STEPS)
    assert len(logits) == STEPS
    with torch.no_grad():
        expected = hf_model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=STEPS, do_sample=False, min_new_tokens=STEPS,
            pad_token_id=0, eos_token_id=None,
        )[0, len(prompt_ids):].tolist()
        ref = hf_model(torch.tensor([prompt_ids + tokens])).logits[0]
    assert tokens == expected
    for step, row in enumerate(logits):
        diff = (row - ref[len(prompt_ids) - 1 + step]).abs().max().item()
        assert diff < ATOL, f"step {step}: max logit difference {diff}"


def make_engine(model_path: str) -> LLMEngine:
    return LLMEngine(
        EngineConfig(model=model_path, dtype="float32", weight_quant="none", cache=CacheConfig(num_blocks=64))
    )


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_random_checkpoints_match_transformers(tmp_path, arch):
    path = make_tiny_hf_model(tmp_path, arch, seed=1)
    engine = make_engine(str(path))
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog and keeps running")
    check_parity(engine, hf_model, prompt)


def test_smollm2_gguf_matches_transformers():
    gguf = smollm2_gguf_path()
    engine = make_engine("default")
    hf_model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf), gguf_file=os.path.basename(gguf), dtype=torch.float32
    ).eval()
    prompt = engine.tokenizer.encode("The history of the Roman Empire begins with")
    check_parity(engine, hf_model, prompt)
