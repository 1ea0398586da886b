"""Constrained decoding: requests whose output must match a JSON schema, a regex, a list of
choices or a grammar.

:mod:`spec` says what a request asks for (:class:`StructuredSpec`, a field of SamplingParams);
:mod:`compiler` turns it into an llguidance matcher (cached by spec) and names what cannot compile;
:mod:`masks` builds the batch's token masks (ahead of the step that uses them) and applies them
to the constrained rows' logits.
The engine is llguidance (https://github.com/guidance-ai/llguidance): no dependencies, a schema
compiles in milliseconds, and its lexer/parser fuel limits bound what a hostile grammar can cost.
"""

from engine.structured.compiler import GrammarCompiler, StructuredOutputError
from engine.structured.masks import MaskBatch, MaskPlanner
from engine.structured.spec import StructuredSpec

__all__ = ["GrammarCompiler", "MaskBatch", "MaskPlanner", "StructuredOutputError", "StructuredSpec"]
