"""Whether a request can run: the one check every request passes, once, as it enters the engine.

``LLMEngine.add_request`` calls it for offline use, ``AsyncEngine.submit`` for the service (which
turns a :class:`RequestError` into a 400 naming ``param``); neither checks again downstream.
The range checks of the sampling fields alone are ``SamplingParams.validate``'s, repeated here
because a caller may change a ``SamplingParams`` after building it.
"""

from __future__ import annotations

from typing import Optional, Sequence

from engine.request import SamplingParams, SamplingParamsError

# Limits that keep one request from taking the server: n sequences per prompt, stop strings
# (each is searched for in every step's new text), and a seed torch's generator accepts.
MAX_N = 128
MAX_STOP_STRINGS = 64
SEED_RANGE = (-(2**63), 2**63 - 1)


class RequestError(ValueError):
    """A request the engine cannot accept (too long, bad token ids...); ``param`` names the culprit."""

    def __init__(self, message: str, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.param = param


def validate_request(prompt_ids: Sequence[int], params: SamplingParams, vocab_size: int, max_model_len: int) -> None:
    """Raise RequestError for anything that cannot run: an empty or out-of-vocabulary prompt, one
    that leaves no room (with ``max_tokens``) in the context, and limits on n, stop, seed, token ids."""
    if not prompt_ids:
        raise RequestError("the prompt is empty", "prompt")
    bad = next((t for t in prompt_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError(f"token id {bad} is outside the vocabulary (0..{vocab_size - 1})", "prompt")
    if len(prompt_ids) >= max_model_len:
        raise RequestError(
            f"the prompt has {len(prompt_ids)} tokens; this model's context is {max_model_len} "
            "tokens and at least one must be left to generate",
            "prompt",
        )
    if params.max_tokens is not None and len(prompt_ids) + params.max_tokens > max_model_len:
        raise RequestError(
            f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds the "
            f"context length of {max_model_len}",
            "max_tokens",
        )
    if params.n > MAX_N:
        raise RequestError(f"'n' must be at most {MAX_N}", "n")
    if len(params.stop) > MAX_STOP_STRINGS:
        raise RequestError(f"'stop' may hold at most {MAX_STOP_STRINGS} strings, got {len(params.stop)}", "stop")
    if params.seed is not None and not SEED_RANGE[0] <= params.seed <= SEED_RANGE[1]:
        raise RequestError("'seed' must be a signed 64-bit integer", "seed")
    for name, ids in (("logit_bias", params.logit_bias.keys()), ("stop_token_ids", params.stop_token_ids)):
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise RequestError(f"{name} names token id {bad}, outside the vocabulary (0..{vocab_size - 1})", name)
    try:
        params.validate()
    except SamplingParamsError as exc:
        raise RequestError(str(exc), exc.param) from None
