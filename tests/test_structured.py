"""Constrained decoding in the engine (engine/structured): masks touch the constrained rows only,
and a hypothesis property over generated JSON schemas — every output that ends with "stop"
validates, at temperature 1, batched with an unconstrained request that must not notice."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.loader import load_model
from engine.request import SamplingParams
from engine.sampler import plain_greedy
from engine.structured import StructuredSpec
from engine.structured.masks import start_masks
from engine.validation import RequestError

PROMPT = "Here is the record as JSON:"
PLAIN = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    cfg = EngineConfig(
        model="default", dtype="float32", weight_quant="none",
        cache=CacheConfig(num_blocks=256), scheduler=SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=16),
    )
    return LLMEngine(cfg, loaded=load_model("default", torch.float32))


def _run(engine: LLMEngine, requests: dict[str, SamplingParams]) -> dict[str, tuple[str, str]]:
    out = {rid: ["", None] for rid in requests}
    for rid, p in requests.items():
        engine.add_request(rid, PROMPT, p)
    while engine.has_unfinished():
        for d in engine.step()[0]:
            out.setdefault(d.request_id, ["", None])
            out[d.request_id][0] += d.new_text
            if d.finished:
                out[d.request_id][1] = d.finish_reason
    return {k: (v[0], v[1]) for k, v in out.items()}


def test_masks_only_touch_constrained_rows(engine: LLMEngine) -> None:
    spec = StructuredSpec("regex", "[0-9]+", "x")
    reqs = engine.add_request("m", PROMPT, SamplingParams(max_tokens=4, structured=spec))
    free = engine.add_request("f", PROMPT, SamplingParams(max_tokens=4, temperature=0.0))
    assert not plain_greedy(reqs[0]) and plain_greedy(free[0])  # a constrained greedy row skips the fused argmax
    masks = start_masks([free[0], reqs[0]], engine.model_config.vocab_size)
    logits = torch.randn(2, engine.model_config.vocab_size)
    before = logits.clone()
    masks.apply(logits, before)
    assert torch.equal(logits[0], before[0])
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert allowed and all(engine.tokenizer.decode([t]).isdigit() for t in allowed)
    assert masks.seconds > 0
    engine.abort_request("m")
    engine.abort_request("f")


def test_unconstrained_neighbour_unchanged(engine: LLMEngine) -> None:
    alone = _run(engine, {"a": PLAIN})["a"][0]
    spec = StructuredSpec.choice(["alpha", "beta"], "x")
    both = _run(engine, {"a": PLAIN, "c": SamplingParams(max_tokens=8, temperature=1.0, seed=1, structured=spec)})
    assert both["a"][0] == alone
    assert both["c"] == ("alpha", "stop") or both["c"] == ("beta", "stop")


def test_bad_constraint_is_a_request_error(engine: LLMEngine) -> None:
    with pytest.raises(RequestError) as e:
        engine.add_request("bad", PROMPT, SamplingParams(structured=StructuredSpec("regex", "(", "guided_regex")))
    assert e.value.param == "guided_regex"
    assert not engine.has_unfinished()


_leaf = st.one_of(
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 100)),
    st.lists(st.text("abcxyz", min_size=1, max_size=5), min_size=1, max_size=4, unique=True).map(lambda v: {"enum": v}),
    st.just({"type": "boolean"}),
    st.integers(1, 8).map(lambda n: {"type": "string", "maxLength": n}),
    st.just({"type": "string", "pattern": "^[a-z]{2,4}$"}),
)


def _object(children: st.SearchStrategy) -> st.SearchStrategy:
    props = st.dictionaries(st.text("abcdefgh", min_size=1, max_size=4), children, min_size=1, max_size=3)
    return props.map(lambda p: {"type": "object", "properties": p, "required": sorted(p), "additionalProperties": False})


_schema = st.recursive(
    _leaf,
    lambda inner: st.one_of(_object(inner), inner.map(lambda i: {"type": "array", "items": i, "maxItems": 2})),
    max_leaves=5,
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schema=_object(_schema), seed=st.integers(0, 2**31))
def test_generated_schemas_validate(engine: LLMEngine, schema: dict, seed: int) -> None:
    spec = StructuredSpec.json_schema(schema, "response_format")
    outs = _run(engine, {"s": SamplingParams(max_tokens=96, temperature=1.0, seed=seed, n=2, structured=spec)})
    for rid, (text, reason) in outs.items():
        if rid == "s":
            continue
        if reason == "stop":
            jsonschema.validate(json.loads(text), schema)
        else:
            assert reason == "length" and text.startswith("{")
