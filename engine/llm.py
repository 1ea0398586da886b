"""The offline front door: ``LLM(model="default").generate(["Hello"], SamplingParams(max_tokens=8))``.

Drives an :class:`LLMEngine` step by step on the calling thread until every prompt is done and
gathers each choice's deltas into one :class:`RequestOutput` per prompt, in the prompts' order.
"""

from __future__ import annotations

import itertools
from typing import Optional, Sequence

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.request import CompletionOutput, RequestOutput, SamplingParams
from engine.tokenizer import Tokenizer


class LLM:
    """Offline batch generation over one engine; ``kwargs`` are :class:`EngineConfig` fields."""

    def __init__(self, model: str = "default", config: Optional[EngineConfig] = None, **kwargs) -> None:  # noqa: ANN003
        config = config or EngineConfig(model=model, **kwargs)
        self.engine = LLMEngine(config)
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        params: Optional[SamplingParams | Sequence[SamplingParams]] = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids) with its params (one for all, or one each)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params_list = list(params) if isinstance(params, (list, tuple)) else [params or SamplingParams()] * len(prompts)
        order: list[str] = []
        results: dict[str, RequestOutput] = {}
        for prompt, p in zip(prompts, params_list):
            rid = str(next(self._ids))
            reqs = self.engine.add_request(rid, prompt, p)
            order.append(rid)
            results[rid] = RequestOutput(
                rid,
                reqs[0].prompt_token_ids,
                [CompletionOutput(i, "", [], None) for i in range(p.n)],
            )
        while self.engine.has_unfinished():
            deltas, _, _ = self.engine.step()
            for d in deltas:
                out = results[d.parent_id]
                choice = out.outputs[d.index]
                choice.text += d.new_text
                choice.token_ids.extend(d.new_token_ids)
                choice.logprobs.extend(d.new_logprobs)
                if d.prompt_logprobs is not None:
                    out.prompt_logprobs = d.prompt_logprobs
                out.num_cached_tokens = max(out.num_cached_tokens, d.num_cached_tokens)
                if d.finished:
                    choice.finish_reason = d.finish_reason
                    choice.stop_reason = d.stop_reason
        return [results[rid] for rid in order]
