"""TEST-ONLY fault injection into the real server process.  Off unless ``CPUSERVE_TEST_FAULTS=1``.

The reliability tests (tests/e2e/test_reliability.py) start ``python -m service`` with that
variable set and put a marker in a prompt:

- ``FAIL_STEP``: every engine step holding the request raises, as a kernel bug would; the requests
  in that step fail (500, or an error event then ``[DONE]``) and the engine keeps serving.
- ``KILL_ENGINE``: the engine loop itself dies; every open stream ends with an error event,
  ``/health`` turns 503 and the process exits non-zero so an orchestrator restarts it.
- ``SLOW_STEP``: each step holding the request sleeps ``SLOW_STEP_S`` (to cancel it mid-prefill).

Never set the variable in production: any client could then stop the server with one prompt.
"""

from __future__ import annotations

import logging
import time
from typing import Mapping, Optional

from engine import envs
from engine.engine import LLMEngine
from engine.scheduler import SchedulerOutput

ENV = "CPUSERVE_TEST_FAULTS"
FAIL_STEP = "__cpuserve_fault_fail_step__"
KILL_ENGINE = "__cpuserve_fault_kill_engine__"
SLOW_STEP = "__cpuserve_fault_slow_step__"
SLOW_STEP_S = 0.25

logger = logging.getLogger("service")


class InjectedStepError(RuntimeError):
    """A step failure, as a kernel bug would raise it."""


class InjectedEngineDeath(BaseException):
    """Not an ``Exception``: it gets past the step's own error handling and ends the engine loop."""


def enabled(env: Optional[Mapping[str, str]] = None) -> bool:
    return envs.read(ENV, env)


def install(engine: LLMEngine) -> None:
    """Set ``engine.fault_hook`` to act on the markers above (it runs before the model, every step)."""
    tok = engine.tokenizer

    def hook(sched: SchedulerOutput) -> None:
        texts = [tok.decode(s.request.prompt_token_ids, skip_special_tokens=False) for s in sched.scheduled]
        if any(KILL_ENGINE in t for t in texts):
            raise InjectedEngineDeath("injected fault: the engine loop dies")
        if any(FAIL_STEP in t for t in texts):
            raise InjectedStepError("injected fault: this step fails")
        if any(SLOW_STEP in t for t in texts):
            time.sleep(SLOW_STEP_S)

    engine.fault_hook = hook
    logger.warning("%s=1: TEST-ONLY fault injection is on; never run a real deployment like this", ENV)
