"""AsyncEngine on a fake engine: the queue limit counts sequences, a dying loop fails every
stream and calls on_dead, and requests submitted into one mailbox arrive tagged, in step order."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from engine.async_engine import AsyncEngine, Delivery, EngineDeadError, Mailbox, QueueFullError
from engine.request import CompletionDelta, SamplingParams
from engine.validation import RequestError


class FakeEngine:
    def __init__(self, max_waiting: int) -> None:
        self.config = SimpleNamespace(scheduler=SimpleNamespace(max_waiting=max_waiting))
        self.scheduler = SimpleNamespace(num_waiting=0)
        self.added: list[str] = []
        self.step_error: BaseException | None = None

    def validate(self, prompt_ids, params) -> None:  # noqa: ANN001
        pass

    def enqueue(self, rid, prompt_ids, params, priority, arrival) -> None:  # noqa: ANN001
        self.added.append(rid)
        self.scheduler.num_waiting += params.n  # nothing is ever scheduled: they all wait

    def has_unfinished(self) -> bool:
        return bool(self.added)

    def step(self):  # noqa: ANN201
        if self.step_error is not None:
            raise self.step_error
        time.sleep(0.01)
        return [], None, []

    def abort_request(self, rid):  # noqa: ANN001, ANN201
        return []


def test_queue_limit_counts_sequences_and_an_empty_queue_takes_any_n() -> None:
    async def run() -> None:
        ae = AsyncEngine(FakeEngine(max_waiting=4))
        ae.start()
        ae.add_request("a", [1], SamplingParams(n=10))  # the queue is empty: taken, whatever n
        assert ae.num_waiting == 10
        with pytest.raises(QueueFullError):
            ae.add_request("b", [1], SamplingParams(n=1))
        ae.stop()
        ae2 = AsyncEngine(FakeEngine(max_waiting=4))
        ae2.start()
        ae2.add_request("a", [1], SamplingParams(n=3))
        with pytest.raises(QueueFullError):
            ae2.add_request("b", [1], SamplingParams(n=2))  # 3 + 2 > 4
        ae2.add_request("c", [1], SamplingParams(n=1))  # 3 + 1 = 4
        await asyncio.sleep(0.1)  # handed to the (fake) scheduler: still counted
        assert ae2.num_waiting == 4
        with pytest.raises(QueueFullError):
            ae2.add_request("d", [1], SamplingParams(n=1))
        ae2.stop()

    asyncio.run(run())


class Death(BaseException):
    pass


def test_a_dying_loop_fails_every_stream_and_calls_on_dead() -> None:
    async def run() -> None:
        engine = FakeEngine(max_waiting=8)
        engine.step_error = Death("boom")
        called = threading.Event()
        seen: list[BaseException] = []
        ae = AsyncEngine(engine, on_dead=lambda exc: (seen.append(exc), called.set()))
        ae.start()
        stream = ae.add_request("a", [1], SamplingParams())
        with pytest.raises(EngineDeadError, match="Death"):
            async for _ in stream:
                pass
        assert await asyncio.to_thread(called.wait, 5)
        assert isinstance(seen[0], Death) and not ae.healthy
        with pytest.raises(EngineDeadError):
            ae.add_request("b", [1], SamplingParams())
        ae.stop()

    asyncio.run(run())


class CountingEngine(FakeEngine):
    """Each step gives every live request its next token; a request finishes after 3."""

    def __init__(self) -> None:
        super().__init__(max_waiting=8)
        self.made: dict[str, int] = {}

    def step(self):  # noqa: ANN201
        time.sleep(0.002)
        deltas = []
        for rid in list(self.added):
            k = self.made[rid] = self.made.get(rid, 0) + 1
            done = k == 3
            deltas.append(CompletionDelta(rid, rid, 0, [k], f"{rid}{k}", [], done, "length" if done else None))
            if done:
                self.added.remove(rid)
        return deltas, None, []


def test_submitted_requests_share_one_mailbox_tagged_and_in_step_order() -> None:
    async def run() -> list[tuple[int, str]]:
        ae = AsyncEngine(CountingEngine())
        ae.start()
        box: Mailbox[Delivery] = Mailbox(asyncio.get_running_loop())
        ae.submit([("x", [1]), ("y", [1])], SamplingParams(), box)
        got = []
        while len(got) < 6:
            tag, d = await asyncio.wait_for(box.get(), 5)
            got.append((tag, d.new_text))
        ae.stop()
        return got

    got = asyncio.run(run())
    assert sorted(got) == [(0, "x1"), (0, "x2"), (0, "x3"), (1, "y1"), (1, "y2"), (1, "y3")]
    assert [text for tag, text in got if tag == 0] == ["x1", "x2", "x3"]
    assert [text for tag, text in got if tag == 1] == ["y1", "y2", "y3"]


class PickyEngine(FakeEngine):
    """Rejects the prompt [0], as the real engine rejects an out-of-vocabulary id."""

    def __init__(self) -> None:
        super().__init__(max_waiting=8)
        self.validated: list[list[int]] = []

    def validate(self, prompt_ids, params) -> None:  # noqa: ANN001
        self.validated.append(list(prompt_ids))
        if list(prompt_ids) == [0]:
            raise RequestError("token id 0 is not allowed here", "prompt")


def test_a_request_with_one_bad_prompt_queues_none_of_them() -> None:
    async def run() -> None:
        engine = PickyEngine()
        ae = AsyncEngine(engine)
        ae.start()
        box: Mailbox[Delivery] = Mailbox(asyncio.get_running_loop())
        with pytest.raises(RequestError) as info:
            ae.submit([("a", [1]), ("b", [0]), ("c", [2])], SamplingParams(n=2), box)
        assert info.value.param == "prompt"
        assert ae.num_waiting == 0 and ae.num_unfinished == 0
        with pytest.raises(RequestError, match="already in use"):
            ae.submit([("d", [1]), ("d", [2])], SamplingParams(), box)
        checked = len(engine.validated)
        ae.submit([("e", [1]), ("f", [2])], SamplingParams(n=2), box)
        assert ae.num_waiting == 4
        await asyncio.sleep(0.1)
        assert engine.added == ["e", "f"]  # nothing of the rejected requests reached the engine
        assert engine.validated[checked:] == [[1], [2]]  # each prompt checked once, on its way in
        ae.stop()

    asyncio.run(run())
