"""Request fields -> the engine's SamplingParams, for completions and chat alike.

Range checks are the engine's (``SamplingParams.validate``); a failure comes back as a 400 that
names the field.  ``None`` means "the default", as OpenAI's clients send it.
"""

from __future__ import annotations

from typing import Optional

from engine.request import SamplingParams, SamplingParamsError
from engine.structured import StructuredSpec
from service.errors import bad_request
from service.protocol import SamplingFields


# Parameters OpenAI or vLLM define that this server does not implement, with the value that asks
# for nothing (None: only absent or null is accepted).  Anything else is a 400 naming it.
UNSUPPORTED: dict[str, object] = {
    "use_beam_search": False,
    "length_penalty": 1.0,
    "truncate_prompt_tokens": None,
    "allowed_token_ids": None,
    "bad_words": None,
    "logits_processors": None,
    "return_tokens_as_token_ids": False,
    "prediction": None,
    "functions": None,  # the deprecated form of tools
    "function_call": None,
    "audio": None,
    "modalities": ["text"],
    "web_search_options": None,
    "reasoning_effort": None,
    "continue_final_message": False,
    "chat_template": None,
    "chat_template_kwargs": None,
    "documents": None,
    "echo": False,  # chat only; completions' echo is implemented
}


def reject_unsupported(req: SamplingFields) -> None:
    """400 for a parameter this server would otherwise accept without doing what it asks."""
    for name, neutral in UNSUPPORTED.items():
        if name == "echo" and not hasattr(req, "messages"):
            continue
        value = getattr(req, name, None)
        if value is not None and value != neutral:
            raise bad_request(f"'{name}' is not supported by this server", name)


def build_sampling_params(
    req: SamplingFields,
    *,
    max_tokens: Optional[int],
    logprobs: Optional[int],
    prompt_logprobs: Optional[int],
    structured: Optional[StructuredSpec] = None,
) -> SamplingParams:
    reject_unsupported(req)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    try:
        return SamplingParams(
            n=req.n,
            temperature=_or(req.temperature, 1.0),
            top_p=_or(req.top_p, 1.0),
            top_k=_or(req.top_k, 0),
            min_p=_or(req.min_p, 0.0),
            seed=req.seed,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=stop,
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos,
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            presence_penalty=_or(req.presence_penalty, 0.0),
            frequency_penalty=_or(req.frequency_penalty, 0.0),
            repetition_penalty=_or(req.repetition_penalty, 1.0),
            logit_bias=_logit_bias(req.logit_bias),
            structured=structured,
        )
    except SamplingParamsError as exc:
        raise bad_request(str(exc), exc.param) from None


def _or(value, default):  # noqa: ANN001, ANN202
    return default if value is None else value


def _logit_bias(bias: Optional[dict[str, float]]) -> dict[int, float]:
    out = {}
    for key, value in (bias or {}).items():
        try:
            out[int(key)] = float(value)
        except ValueError:
            raise bad_request(f"'logit_bias' keys must be token ids, got {key!r}", "logit_bias") from None
    return out
