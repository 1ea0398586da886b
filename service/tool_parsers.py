"""What a model wrote -> content and tool calls, for the three formats the server knows.

* ``generic``: the answer service/tools.py constrains a template that knows no tools to:
  ``{"tool_calls":[{"name":..,"arguments":{..}},..]}`` or ``{"content":".."}``.
* ``hermes``: Hermes / Qwen templates: free text with ``<tool_call>{"name": .., "arguments": ..}</tool_call>`` blocks.
* ``llama3_json``: Llama 3.1+ templates: the answer is ``{"name": .., "parameters": ..}`` (several
  separated by ``;``), optionally after ``<|python_tag|>``.

:func:`parse` reads the text so far; ``final=False`` while the choice is still generating, when
it returns only what can no longer change: content that cannot be the start of a call, and each
call once its name is whole, with as much of its arguments as is written.  Called again on a
longer text it returns an extension of what it returned before, which is what lets
:class:`ToolCallStream` send OpenAI's streamed deltas (a call's id and name first, then argument
fragments) by difference, and the non-streamed answer read the very same parse.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Optional

FORMATS = ("generic", "hermes", "llama3_json")
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
# A call's head: its name, then the key its arguments are under (Llama 3 says "parameters").
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_STRING_START = re.compile(r'\{"content":"')


@dataclass
class ParsedCall:
    name: str
    arguments: str  # the arguments' JSON text as written (so far, while ``done`` is False)
    done: bool


@dataclass
class Parsed:
    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)


def detect_format(chat_template: Optional[str]) -> str:
    """The tool-call format a chat template teaches its model, from the template's source:
    ``hermes`` for ``<tool_call>`` blocks (Hermes 2 Pro, Qwen 2/2.5/3), ``llama3_json`` for Llama
    3.1+'s JSON calls, else ``generic`` (the template knows no tools: the server describes them)."""
    source = chat_template or ""
    if _OPEN in source and "tools" in source:
        return "hermes"
    if "tools" in source and ('"parameters": dictionary of argument name' in source or _PYTHON_TAG in source):
        return "llama3_json"
    return "generic"


def parse(fmt: str, text: str, names: set[str], final: bool) -> Parsed:
    """``text`` read in format ``fmt`` (one of FORMATS); only calls to ``names`` count as calls."""
    if fmt == "hermes":
        return _hermes(text, names, final)
    if fmt == "llama3_json":
        return _llama3(text, names, final)
    return _generic(text, names, final)


def _call(text: str, pos: int, names: set[str], end: int) -> Optional[tuple[ParsedCall, int]]:
    """The call whose JSON object starts at ``pos`` (ends by ``end``), and where its object ends
    (``end`` when not yet closed); None when what is there is not (yet) a call's head."""
    m = _HEAD.match(text, pos, end)
    if m is None:
        return None
    name = _unescape(m.group(1))
    if name not in names:
        return None
    args_end = _value_end(text, m.end(), end)
    if args_end is None:
        return ParsedCall(name, text[m.end() : end], False), end
    close = re.compile(r"\s*\}").match(text, args_end, end)
    return ParsedCall(name, text[m.end() : args_end], close is not None), close.end() if close else end


def _hermes(text: str, names: set[str], final: bool) -> Parsed:
    out = Parsed()
    pos = 0
    while True:
        start = text.find(_OPEN, pos)
        if start < 0:
            tail = text[pos:]
            out.content += tail if final else tail[: len(tail) - _partial_suffix(tail, _OPEN)]
            break
        out.content += text[pos:start]
        body = start + len(_OPEN)
        close = text.find(_CLOSE, body)
        end = close if close >= 0 else len(text)
        found = _call(text, body, names, end)
        if found is not None:
            out.calls.append(found[0])
        elif close >= 0 or final:
            out.content += text[start : close + len(_CLOSE) if close >= 0 else len(text)]  # not a call: text
        else:
            break  # a block whose head is still being written
        if close < 0:
            break
        pos = close + len(_CLOSE)
    out.content = _trim(out.content, final)
    return out


def _llama3(text: str, names: set[str], final: bool) -> Parsed:
    out = Parsed()
    body = text.lstrip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG) :]
    elif not final and _PYTHON_TAG.startswith(body):
        return out  # nothing yet, or the tag being written
    pos = len(text) - len(body)
    while True:
        found = _call(text, pos, names, len(text))
        if found is None:
            if not final and _could_be_head(text[pos:]):
                return out  # a call's head (or prose that begins like one) still being written
            out.content = _trim(text[pos:] if out.calls else body, final)
            return out
        call, pos = found
        out.calls.append(call)
        sep = re.compile(r"\s*;?\s*").match(text, pos)
        if not call.done or sep.end() == len(text):
            return out
        pos = sep.end()


def _generic(text: str, names: set[str], final: bool) -> Parsed:
    out = Parsed()
    m = _STRING_START.match(text)
    if m is not None:
        out.content = _json_string_prefix(text, m.end())
        return out
    prefix = '{"tool_calls":['
    if not text.startswith(prefix):
        if final and not prefix.startswith(text) and not '{"content":"'.startswith(text):
            out.content = text  # not the constrained answer (cannot happen under the grammar)
        return out
    pos = len(prefix)
    while pos < len(text):
        found = _call(text, pos, names, len(text))
        if found is None:
            break
        call, pos = found
        out.calls.append(call)
        if not call.done or not text.startswith(",", pos):
            break
        pos += 1
    return out


def _value_end(text: str, pos: int, end: int) -> Optional[int]:
    """Where the JSON value starting at ``pos`` ends (exclusive), or None if it is not finished by
    ``end``.  Tracks brackets and strings only: the constrained decoder or json.loads judges the rest."""
    i = pos
    while i < end and text[i].isspace():
        i += 1
    if i >= end:
        return None
    if text[i] not in "{[\"":
        m = re.compile(r"-?[0-9.eE+\-]+|true|false|null").match(text, i, end)
        return m.end() if m is not None and m.end() < end else None
    depth, in_string, escaped = 0, False, False
    for j in range(i, end):
        c = text[j]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
                if depth == 0:
                    return j + 1
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
    return None


def _json_string_prefix(text: str, pos: int) -> str:
    """The decoded characters of the JSON string whose body starts at ``pos``, as far as written
    (an escape still being written is left out)."""
    end = _value_end(text, pos - 1, len(text))
    body = text[pos : end - 1] if end is not None else text[pos:]
    for cut in range(len(body), max(-1, len(body) - 7), -1):  # the longest prefix that decodes (\uXXXX is 6)
        try:
            return json.loads('"' + body[:cut] + '"')
        except json.JSONDecodeError:
            continue
    return ""


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def _could_be_head(text: str) -> bool:
    """Whether ``text`` is a proper start of a call's head (``{"name": "..", "arguments": ``), so
    that it is not yet known to be prose; whitespace-only text counts."""
    i = 0
    for part in ("{", '"name"', ":", None, ",", ('"arguments"', '"parameters"'), ":"):
        while i < len(text) and text[i].isspace():
            i += 1
        rest = text[i:]
        if not rest:
            return True
        if part is None:  # the name: a JSON string
            if rest[0] != '"':
                return False
            end = _value_end(text, i, len(text))
            if end is None:
                return True
            i = end
            continue
        options = (part,) if isinstance(part, str) else part
        if any(o.startswith(rest) for o in options):
            return True
        hit = next((o for o in options if rest.startswith(o)), None)
        if hit is None:
            return False
        i += len(hit)
    return False  # a whole head: _call already judged it


def _trim(content: str, final: bool) -> str:
    """Content without its surrounding whitespace (what separates calls); while generating,
    trailing whitespace is held since it may turn out to be such a separator."""
    content = content.lstrip()
    return content.rstrip() if final else content[: len(content.rstrip())]


def _unescape(s: str) -> str:
    try:
        return json.loads('"' + s + '"')
    except json.JSONDecodeError:
        return s


@dataclass
class CallDelta:
    """One streamed piece of a tool call: the first of each call carries its ``id`` and ``name``."""

    index: int
    id: Optional[str]
    name: Optional[str]
    arguments: str


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallStream:
    """One choice's text -> what is new since the last call: content, and tool-call pieces.

    ``feed`` the choice's new text; ``final`` once it finished.  Calls past the first are dropped
    when ``parallel`` is False.
    """

    def __init__(self, fmt: str, names: set[str], parallel: bool) -> None:
        self.fmt = fmt
        self.names = names
        self.parallel = parallel
        self.text = ""
        self.content_sent = 0
        self.ids: list[str] = []
        self.args_sent: list[int] = []
        self.last = Parsed()

    def feed(self, new_text: str, final: bool) -> tuple[str, list[CallDelta]]:
        self.text += new_text
        parsed = parse(self.fmt, self.text, self.names, final)
        if not self.parallel:
            parsed.calls = parsed.calls[:1]
        self.last = parsed
        content = parsed.content[self.content_sent :]
        self.content_sent = max(self.content_sent, len(parsed.content))
        out = []
        for k, call in enumerate(parsed.calls):
            if k == len(self.ids):
                self.ids.append(new_call_id())
                self.args_sent.append(0)
                out.append(CallDelta(k, self.ids[k], call.name, ""))
            if len(call.arguments) > self.args_sent[k]:
                out.append(CallDelta(k, None, None, call.arguments[self.args_sent[k] :]))
                self.args_sent[k] = len(call.arguments)
        return content, out

    @property
    def complete(self) -> bool:
        """Every call seen so far is whole (a choice cut by max_tokens may end inside one)."""
        return all(c.done for c in self.last.calls)
