"""Constrained decoding in the engine (engine/structured): masks touch the constrained rows only,
and a hypothesis property over generated JSON schemas — every output that ends with "stop"
validates, at temperature 1, batched with an unconstrained request that must not notice."""

from __future__ import annotations

import functools
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
from engine.sampler import fused_argmax, plain_greedy
from engine.structured import StructuredSpec
from engine.structured.masks import MaskBatch, MaskPlanner, _mask_rows
from engine.validation import RequestError

PROMPT = "Here is the record as JSON:"
PLAIN = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    cfg = EngineConfig(
        model="default", dtype="float32",
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
    reqs = engine.add_request("m", PROMPT, SamplingParams(max_tokens=4, top_p=0.9, structured=spec))  # masked ahead
    free = engine.add_request("f", PROMPT, SamplingParams(max_tokens=4, temperature=0.0))
    assert not plain_greedy(reqs[0]) and plain_greedy(free[0])  # a constrained greedy row skips the fused argmax
    assert fused_argmax([free[0]]) and not fused_argmax([free[0], reqs[0]])  # ... and so does its step
    masks = MaskPlanner(engine.model_config.vocab_size).for_step([free[0], reqs[0]])
    logits = torch.randn(2, engine.model_config.vocab_size)
    before = logits.clone()
    masks.apply(logits, before, [free[0], reqs[0]])
    assert torch.equal(logits[0], before[0])
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert allowed and all(engine.tokenizer.decode([t]).isdigit() for t in allowed)
    assert masks.seconds > 0
    engine.abort_request("m")
    engine.abort_request("f")


def _mask_paths() -> list:
    """None (the torch path) and each native path this CPU runs (engine/csrc/sampling.cpp)."""
    from engine.structured import masks as masks_mod

    op = masks_mod._native_mask_op()
    if op is None:
        return [None]
    from engine.sampler import _native_op

    return [None] + list(_native_op("argmax_isas")())


@pytest.mark.parametrize("isa", _mask_paths())
def test_mask_rows_native_and_torch_agree(isa, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whole-zero, whole-one and mixed bitmask words, a logits width past the mask (model padding),
    logits already -inf, and a row the mask leaves empty: every native path and the torch path give
    the logits the bitmask says and the same "still has a token" flags."""
    from engine.structured import masks as masks_mod

    op = masks_mod._native_mask_op()
    monkeypatch.setattr(masks_mod, "_native_mask_op", lambda: None if isa is None else functools.partial(op, isa=isa))
    g = torch.Generator().manual_seed(0)
    vocab, width = 1000, 1024  # 1000 tokens in the tokenizer, 1024 logits columns
    bits = torch.randint(-(2**31), 2**31 - 1, (4, (vocab + 31) // 32), generator=g, dtype=torch.int32)
    bits[0, :10] = 0
    bits[1, 5:20] = -1
    bits[2] = 0  # nothing allowed
    bits[3, 3] = 1 << 7
    logits = torch.randn(6, width, generator=g)
    logits[4, :500] = -float("inf")
    rows = torch.tensor([5, 0, 3, 4])
    want = logits.clone()
    for m, r in enumerate(rows.tolist()):
        allowed = [(int(bits[m, t // 32]) >> (t % 32)) & 1 == 1 for t in range(vocab)] + [False] * (width - vocab)
        want[r, ~torch.tensor(allowed)] = -float("inf")
    alive = _mask_rows(logits, bits, rows, vocab)
    assert torch.equal(logits, want)
    assert alive.tolist() == [bool(torch.isfinite(want[r]).any()) for r in rows.tolist()] == [True, True, False, True]


def test_masks_are_started_at_commit_and_reused_by_the_next_step(engine: LLMEngine) -> None:
    """After a step commits its tokens, the next step's masks are already being built for the same
    rows and equal masks built afresh; a row that joins makes the step build its own batch."""
    spec = StructuredSpec("regex", "[0-9]{3}-[a-z]{3}", "x")
    reqs = engine.add_request("p", PROMPT, SamplingParams(max_tokens=8, top_p=0.9, structured=spec))  # masked ahead
    later = engine.add_request("q", PROMPT, SamplingParams(max_tokens=8, top_p=0.9, structured=spec))
    planner = MaskPlanner(engine.model_config.vocab_size)
    first = planner.for_step(reqs)
    first.wait()
    (token,) = engine.tokenizer.encode("1", False)
    assert (int(first.bits[0, token // 32]) >> (token % 32)) & 1  # a digit may come first
    for _ in range(2):  # "1", then "11": the next mask still allows digits, then only digits or "-"
        reqs[0].append_token(token)
        planner.commit(reqs, [token])
        ahead = planner.for_step(reqs)
        fresh = MaskBatch(reqs, engine.model_config.vocab_size)
        ahead.wait()
        fresh.wait()
        assert ahead is not first and ahead.covers(reqs) and not first.covers(reqs)
        assert torch.equal(ahead.bits, fresh.bits)
    reqs[0].append_token(token)  # "111"
    planner.commit(reqs, [token])
    ahead = planner._ahead
    both = planner.for_step(reqs + later)
    assert ahead is not None and both is not ahead and both.requests == reqs + later
    both.wait()
    (dash,) = engine.tokenizer.encode("-", False)
    assert torch.equal(both.bits[0], ahead.bits[0]) and (int(both.bits[0, dash // 32]) >> (dash % 32)) & 1
    engine.abort_request("p")
    engine.abort_request("q")


def test_unconstrained_neighbour_unchanged(engine: LLMEngine) -> None:
    alone = _run(engine, {"a": PLAIN})["a"][0]
    spec = StructuredSpec.choice(["alpha", "beta"], "x")
    both = _run(engine, {"a": PLAIN, "c": SamplingParams(max_tokens=8, temperature=1.0, seed=1, structured=spec)})
    assert both["a"][0] == alone
    assert both["c"] == ("alpha", "stop") or both["c"] == ("beta", "stop")


def test_constrained_row_takes_one_lm_head_pass_with_its_neighbours(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step with a constrained request among plain greedy ones reads the LM head once, for logits
    of every row (not a fused argmax for the plain rows plus a second pass for the constrained one);
    once the constrained request is done, its neighbours go back to the fused argmax."""
    model = engine.runner.model
    greedy_tokens, compute_logits = model.greedy_tokens, model.compute_logits
    if greedy_tokens(torch.zeros(1, engine.model_config.hidden_size)) is None:
        pytest.skip("this LM head has no fused argmax (no native kernels)")
    fused, logits = [], []
    monkeypatch.setattr(model, "greedy_tokens", lambda h: fused.append(h.shape[0]) or greedy_tokens(h))
    monkeypatch.setattr(model, "compute_logits", lambda h: logits.append(h.shape[0]) or compute_logits(h))
    spec = StructuredSpec("regex", "[a-z]{6}", "x")
    out = _run(engine, {"a": PLAIN, "b": PLAIN, "c": SamplingParams(max_tokens=8, temperature=0.0, structured=spec)})
    assert len(out["c"][0]) == 6 and out["c"][1] == "stop"
    assert logits.count(3) >= 2 and set(logits) == {3} and set(fused) == {2}, (fused, logits)


def test_rows_are_checked_not_masked_unless_truncated(engine: LLMEngine) -> None:
    """A greedy constrained row, or one drawn from an untruncated distribution, gets no mask ahead
    of its step; after sampling, a token its grammar accepts stands without one, and a refused token
    makes the mask of that row alone.  A row drawn under top-p is masked ahead."""
    spec = StructuredSpec("regex", "[0-9]+", "x")
    greedy = engine.add_request("g", PROMPT, SamplingParams(max_tokens=4, temperature=0.0, structured=spec))[0]
    drawn = engine.add_request("d", PROMPT, SamplingParams(max_tokens=4, temperature=0.7, structured=spec))[0]
    top_p = engine.add_request("t", PROMPT, SamplingParams(max_tokens=4, temperature=1.0, top_p=0.9, structured=spec))[0]
    batch = MaskPlanner(engine.model_config.vocab_size).for_step([greedy, drawn, top_p])
    assert batch.requests == [top_p]
    (digit,) = engine.tokenizer.encode("7", False)
    letter = engine.tokenizer.encode("hello", False)[0]
    assert batch.refused([greedy, drawn, top_p], [digit, digit, letter]) == [] and batch.late is None
    assert batch.refused([top_p, greedy, drawn], [letter, letter, digit]) == [1]
    logits = torch.randn(2, engine.model_config.vocab_size)
    before = logits.clone()
    batch.late.apply(logits, before, [top_p, greedy])
    assert torch.equal(logits[0], before[0])
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert digit in allowed and all(engine.tokenizer.decode([t]).isdigit() for t in allowed)
    assert batch.seconds >= batch.late.seconds > 0
    for rid in "gdt":
        engine.abort_request(rid)


def test_a_checked_draw_follows_the_masked_distribution(engine: LLMEngine) -> None:
    """Drawing without the mask and drawing again from the masked logits when the grammar refuses
    the token draws from the masked distribution: logits giving "a" 0.2, "b" 0.1 and "c" 0.7 under
    a grammar that allows only "a" or "b" give "a" 2/3 of the time."""
    from engine.sampler import sample

    spec = StructuredSpec("regex", "[ab]", "x")
    req = engine.add_request("ab", PROMPT, SamplingParams(max_tokens=1, temperature=1.0, seed=3, structured=spec))[0]
    ids = [engine.tokenizer.encode(c, False)[0] for c in "abc"]
    planner = MaskPlanner(engine.model_config.vocab_size)
    logits = torch.full((1, engine.model_config.vocab_size), -float("inf"))
    logits[0, ids] = torch.tensor([0.2, 0.1, 0.7]).log()
    drawn = [sample(logits.clone(), [req], planner.for_step([req])).token_ids[0] for _ in range(1500)]
    assert set(drawn) <= set(ids[:2])
    assert abs(drawn.count(ids[0]) / len(drawn) - 2 / 3) < 0.05  # 4 standard deviations
    engine.abort_request("ab")


def test_greedy_check_gives_the_tokens_of_masking_every_step(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Checking a greedy row's argmax against its grammar is exact: the same outputs as building and
    applying its mask at every step (a JSON schema and a regex whose first tokens the model's own
    argmax breaks)."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "tags": {"type": "array", "items": {"enum": ["x", "yz"]}}},
              "required": ["n", "tags"], "additionalProperties": False}
    requests = {
        "j": SamplingParams(max_tokens=40, temperature=0.0, structured=StructuredSpec.json_schema(schema, "x")),
        "r": SamplingParams(max_tokens=12, temperature=0.0, structured=StructuredSpec("regex", "[0-9]{2}-[a-z]+", "x")),
        "p": PLAIN,
    }
    checked = _run(engine, requests)
    refused: list[int] = []
    real = MaskBatch.refused

    def mask_every_greedy_row(self: MaskBatch, reqs, tokens) -> list[int]:  # noqa: ANN001
        rows = real(self, reqs, tokens)
        refused.append(len(rows))
        every = [i for i, r in enumerate(reqs) if r.matcher is not None and r.params.greedy]
        self.late = MaskBatch([reqs[i] for i in every], self.vocab_size) if every else None
        return every

    monkeypatch.setattr(MaskBatch, "refused", mask_every_greedy_row)
    assert _run(engine, requests) == checked
    assert 0 < sum(refused) < len(refused) * 2  # some argmaxes were refused, most were not
    json.loads(checked["j"][0])


def _finish(engine: LLMEngine, rid: str, params: SamplingParams) -> tuple[str, str, object]:
    """(text, finish_reason, stop_reason) of one request run alone."""
    engine.add_request(rid, PROMPT, params)
    text, last = "", None
    while engine.has_unfinished():
        for d in engine.step()[0]:
            text += d.new_text
            last = d if d.finished else last
    return text, last.finish_reason, last.stop_reason


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_stop_string_inside_constrained_output_does_not_cut_it(engine: LLMEngine, temperature: float) -> None:
    """A stop string ends a constrained output only where the returned text is complete: "END"
    without the stop string left "xy" (not a match), so generation goes on to the grammar's end;
    with include_stop_str_in_output the kept "xyEND" is complete, so the stop string ends it."""
    spec = StructuredSpec("regex", "[a-z]{2}END", "guided_regex")
    params = dict(max_tokens=16, temperature=temperature, seed=5, structured=spec, stop=["END"])
    text, reason, stop_reason = _finish(engine, "s1", SamplingParams(**params))
    assert reason == "stop" and stop_reason is None and len(text) == 5 and text.endswith("END"), (text, reason)
    text, reason, stop_reason = _finish(engine, "s2", SamplingParams(**params, include_stop_str_in_output=True))
    assert (reason, stop_reason) == ("stop", "END") and len(text) == 5 and text.endswith("END"), (text, reason)


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
@given(schema=_object(_schema), seed=st.integers(0, 2**31), stop=st.sampled_from([[], ["}"], [","], ['"', "]"]]))
def test_generated_schemas_validate(engine: LLMEngine, schema: dict, seed: int, stop: list[str]) -> None:
    """Stop strings included: one that would cut the JSON short must not end it with "stop"."""
    spec = StructuredSpec.json_schema(schema, "response_format")
    params = SamplingParams(max_tokens=96, temperature=1.0, seed=seed, n=2, structured=spec, stop=stop,
                            include_stop_str_in_output=bool(seed % 2))
    outs = _run(engine, {"s": params})
    for rid, (text, reason) in outs.items():
        if rid == "s":
            continue
        if reason == "stop":
            jsonschema.validate(json.loads(text), schema)
        else:
            assert reason == "length" and text.startswith("{")
