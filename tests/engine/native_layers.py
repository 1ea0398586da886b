"""Running one engine with its native decoder layers and then on the modular path, for the tests
that check both paths give the same bits."""

from __future__ import annotations

from typing import Any, Sequence

from engine.engine import LLMEngine
from engine.request import SamplingParams


def logprob_outputs(engine: LLMEngine, prompts: Sequence[str], params: SamplingParams) -> dict[str, list[Any]]:
    """Each request's (token, logprob, top logprobs) per generated token (``params`` must ask for logprobs)."""
    out: dict[str, list[Any]] = {}
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    while engine.has_unfinished():
        for d in engine.step()[0]:
            out.setdefault(d.request_id, []).extend((lp.token_id, lp.logprob, tuple(lp.top)) for lp in d.new_logprobs)
    return out


def native_and_modular(engine: LLMEngine, prompts: Sequence[str], params: SamplingParams) -> tuple[dict, dict]:
    """:func:`logprob_outputs` with the model's native decoder layers as bound at load, then with every
    layer on the modular path (the reference); the native layers are bound again after."""
    model = engine.runner.model
    native = logprob_outputs(engine, prompts, params)
    saved = [layer.packed for layer in model.layers]
    body, model.packed_body = model.packed_body, None
    for layer in model.layers:
        layer.packed = None
    try:
        modular = logprob_outputs(engine, prompts, params)
    finally:
        for layer, packed in zip(model.layers, saved):
            layer.packed = packed
        model.packed_body = body
    return native, modular
