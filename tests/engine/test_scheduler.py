"""Scheduler policy without a model: budgets, chunking, preemption, aborts."""

from engine.config import SchedulerConfig
from engine.kv_cache import KVCacheManager
from engine.request import Request, RequestStatus, SamplingParams
from engine.scheduler import Scheduler


def make(num_blocks=64, block_size=4, **cfg) -> Scheduler:
    return Scheduler(SchedulerConfig(**cfg), KVCacheManager(num_blocks, block_size), max_model_len=1000)


def req(rid, n_prompt, seq, priority=0, **kw) -> Request:
    return Request(rid, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=kw.pop("max_tokens", 50), **kw),
                   eos_token_ids=(0,), priority=priority, arrival_seq=seq)


def run_step(s: Scheduler, token: int = 5):
    out = s.schedule()
    sampled = {x.request.request_id: token for x in out.scheduled if x.samples}
    s.update(out, sampled)
    return out


def test_token_budget_and_chunked_prefill():
    s = make(max_num_batched_tokens=10)
    a = req("a", 25, 0)
    s.add(a)
    out = run_step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 10)]
    assert a.num_computed_tokens == 10 and a.num_output_tokens == 0
    run_step(s)
    out = run_step(s)
    assert out.scheduled[0].num_new_tokens == 5 and a.num_output_tokens == 1


def test_running_first_then_waiting_fcfs_and_max_num_seqs():
    s = make(max_num_batched_tokens=100, max_num_seqs=2)
    for i in range(3):
        s.add(req(f"r{i}", 4, i))
    out = run_step(s)
    assert sorted(x.request.request_id for x in out.scheduled) == ["r0", "r1"]
    out = run_step(s)
    assert sorted(x.request.request_id for x in out.scheduled) == ["r0", "r1"]  # r2 waits for a free seat
    assert out.num_decode_tokens == 2 and out.num_prefill_tokens == 0


def test_priority_orders_admission():
    s = make(max_num_batched_tokens=4)
    s.add(req("low", 4, 0, priority=5))
    s.add(req("high", 4, 1, priority=0))
    out = run_step(s)
    assert [x.request.request_id for x in out.scheduled] == ["high"]


def test_preemption_by_recompute_never_loses_a_request():
    s = make(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    a, b = req("a", 8, 0, max_tokens=6, ignore_eos=True), req("b", 8, 1, max_tokens=6, ignore_eos=True)
    s.add(a)
    s.add(b)
    run_step(s)  # both prefilled: 2 blocks each, pool full
    assert s.kv.num_free_blocks == 0
    out = run_step(s)  # a needs a third block for position 8 -> b (latest arrival) is preempted
    assert b in out.preempted and b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert s.num_preemptions == 1 and b in s.waiting
    steps = 0
    while s.has_work() and steps < 500:
        run_step(s)
        steps += 1
    assert a.is_finished and b.is_finished
    assert a.status == b.status == RequestStatus.FINISHED_LENGTH
    assert s.kv.num_free_blocks == 4


def test_abort_anywhere_frees_blocks():
    s = make(max_num_batched_tokens=8)
    a, b = req("a", 20, 0), req("b", 4, 1)
    s.add(a)
    s.add(b)
    run_step(s)  # a mid-prefill, b waiting
    assert a.num_computed_tokens == 8
    s.finish(a, RequestStatus.FINISHED_ABORTED)
    s.finish(b, RequestStatus.FINISHED_ABORTED)
    assert not s.has_work()
    assert s.kv.num_free_blocks == 64


def test_stop_conditions():
    s = make(max_num_batched_tokens=64)
    eos = req("eos", 4, 0)
    ignore = req("ignore", 4, 1, ignore_eos=True, max_tokens=3)
    length = req("len", 4, 2, max_tokens=2, ignore_eos=True)
    stop_id = req("sid", 4, 3, stop_token_ids=[7])
    min_tok = req("min", 4, 4, min_tokens=2)
    for r in (eos, ignore, length, stop_id, min_tok):
        s.add(r)
    run_step(s, token=0)  # everyone samples EOS
    assert eos.status == RequestStatus.FINISHED_STOPPED and eos.stop_reason is None
    assert stop_id.status == RequestStatus.FINISHED_STOPPED  # EOS applies to it too
    assert ignore.status == RequestStatus.RUNNING
    assert min_tok.status == RequestStatus.RUNNING  # EOS before min_tokens does not stop
    run_step(s, token=7)
    assert length.status == RequestStatus.FINISHED_LENGTH and length.num_output_tokens == 2
    run_step(s, token=0)
    assert ignore.status == RequestStatus.FINISHED_LENGTH and ignore.num_output_tokens == 3
    assert min_tok.status == RequestStatus.FINISHED_STOPPED and min_tok.num_output_tokens == 3
    s2 = make(max_num_batched_tokens=64)
    sid = req("sid", 4, 0, stop_token_ids=[7])
    s2.add(sid)
    run_step(s2, token=7)
    assert sid.status == RequestStatus.FINISHED_STOPPED and sid.stop_reason == 7


def test_decodes_ride_on_top_of_the_prompt_token_budget():
    """A running decode does not take prompt tokens: with a budget of 8 and two streams decoding,
    a 16-token prompt still goes in two chunks of 8, so its first token comes after 2 steps, not 3."""
    s = make(max_num_batched_tokens=8)
    a, b = req("a", 4, 0, max_tokens=20), req("b", 4, 1, max_tokens=20)
    s.add(a)
    s.add(b)
    run_step(s)  # both prompts (8 tokens) in one step
    c = req("c", 16, 2)
    s.add(c)
    out = run_step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1), ("b", 1), ("c", 8)]
    assert out.num_decode_tokens == 2 and out.num_prefill_tokens == 8 and out.total_num_tokens == 10
    run_step(s)
    assert c.num_output_tokens == 1 and c.num_computed_tokens == 16


def test_prompt_budget_still_caps_chunks_of_running_prompts():
    s = make(max_num_batched_tokens=6)
    a, b = req("a", 10, 0), req("b", 10, 1)
    s.add(a)
    s.add(b)
    out = run_step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 6)]
    out = run_step(s)  # a's last 4 prompt tokens, then b's first 2
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 4), ("b", 2)]
