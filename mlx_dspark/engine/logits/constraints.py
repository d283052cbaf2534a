"""Output constraints: JSON Schema, any JSON object, a regex, a grammar, forced tool calls.

A `Constraint` is plain data (what the user asked for); `compile_constraint` turns it into a
`grammar.GrammarState` for one request against the model's tokenizer. The grammar engine is
llguidance (the one llama.cpp uses; docs/CONSTRAINTS.md has the measurements that chose it): JSON
Schema and regexes go through its compilers, grammars are its Lark dialect (a llama.cpp GBNF grammar is
converted to it), and tool calls are a Lark grammar of literal markers around `%json` schemas.
Every problem a user can cause is a `ConstraintError` naming the constraint kind (`field`).
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "grammar", "tool_calls")
# JSON whitespace between tokens: bounded (a weak model cannot spend its budget on blanks), but present,
# since llguidance's no-whitespace mode also forbids tokens across lexeme boundaries (`{"` as one token)
JSON_OPTIONS = {"whitespace_pattern": r"\x20?"}


class ConstraintError(ValueError):
    """A schema, regex or grammar the engine cannot use; `field` is the constraint kind it came from."""

    def __init__(self, field: str, message: str) -> None:
        # the engine's messages span lines (source excerpts, ^ pointers): one line, for a CLI error or a 400
        parts = [line.strip() for line in message.splitlines()]
        message = " ".join(part for part in parts if part and set(part) != {"^"})
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class ToolCallShape:
    """One forced call: the output is `begin + <JSON matching schema> + end` (the template's call syntax)."""

    begin: str
    schema: Mapping[str, Any]
    end: str


@dataclass(frozen=True)
class Constraint:
    """What the output must match. Build one with the class methods; `grammar` is the engine's text."""

    kind: str
    grammar: str  # the llguidance grammar (its JSON form or Lark), built once from the user's input

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str) -> "Constraint":
        """Output one JSON value valid under `schema` (a dict or its JSON text), strictly."""
        return cls("json_schema", _from_schema("json_schema", schema))

    @classmethod
    def json_object(cls) -> "Constraint":
        """Output any one JSON object (OpenAI's `response_format: json_object`)."""
        return cls("json_object", _from_schema("json_object", {"type": "object"}))

    @classmethod
    def regex(cls, pattern: str) -> "Constraint":
        """The whole output matches `pattern` (Rust regex syntax; anchored at both ends)."""
        if not isinstance(pattern, str) or not pattern:
            raise ConstraintError("regex", f"expected a non-empty pattern string, got {pattern!r}")
        return cls("regex", _llg().LLMatcher.grammar_from_regex(pattern))

    @classmethod
    def grammar(cls, text: str) -> "Constraint":
        """A grammar in llguidance's Lark dialect (`start: ...`), or a llama.cpp GBNF grammar (`root ::= ...`)."""
        if not isinstance(text, str) or not text.strip():
            raise ConstraintError("grammar", f"expected a non-empty grammar text, got {text!r}")
        from llguidance.gbnf_to_lark import any_to_lark

        try:
            lark = any_to_lark(text)
        except Exception as err:  # the converter raises plain exceptions on GBNF syntax errors
            raise ConstraintError("grammar", f"not a valid GBNF or Lark grammar: {err}") from None
        return cls("grammar", _llg().LLMatcher.grammar_from_lark(lark))

    @classmethod
    def tool_calls(cls, shapes: Sequence[ToolCallShape], *, parallel: bool) -> "Constraint":
        """One call (or, with `parallel`, one or more separated by optional whitespace) of any of `shapes`."""
        if not shapes or not all(isinstance(s, ToolCallShape) for s in shapes):
            raise ConstraintError("tool_calls", f"expected a non-empty list of ToolCallShape, got {shapes!r}")
        rules = []
        for i, shape in enumerate(shapes):
            _check_schema("tool_calls", shape.schema)
            if not (isinstance(shape.begin, str) and isinstance(shape.end, str)):
                raise ConstraintError("tool_calls", f"shape {i}: begin and end must be strings")
            # JSON string literals are valid Lark literals; %json embeds the schema as its own rule (compact JSON)
            body = f"%json {json.dumps({**shape.schema, 'x-guidance': JSON_OPTIONS})}"
            rules.append(f"call_{i}: {_lark_literal(shape.begin)} args_{i} {_lark_literal(shape.end)}\nargs_{i}: {body}")
        calls = " | ".join(f"call_{i}" for i in range(len(shapes)))
        start = "start: call (SEP? call)*" if parallel else "start: call"
        lark = "\n".join([start, f"call: {calls}", "SEP: /[ \\t\\r\\n]{1,3}/", *rules])
        return cls("tool_calls", _llg().LLMatcher.grammar_from_lark(lark))


def _lark_literal(text: str) -> str:
    return json.dumps(text) if text else '""'


def _llg() -> Any:
    import llguidance  # imported on first use: building Constraint objects needs it, importing the package does not

    return llguidance


def _check_schema(field: str, schema: Any) -> Mapping[str, Any]:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as err:
            raise ConstraintError(field, f"the schema is not valid JSON: {err}") from None
    if not isinstance(schema, Mapping):
        raise ConstraintError(field, f"a JSON Schema must be a JSON object, got {type(schema).__name__}")
    return schema


def _from_schema(field: str, schema: Any) -> str:
    schema = _check_schema(field, schema)
    try:
        return _llg().LLMatcher.grammar_from_json_schema(dict(schema), defaults=JSON_OPTIONS)
    except ValueError as err:
        raise ConstraintError(field, str(err)) from None


# An LLTokenizer costs up to a second to build at a real vocabulary: one per tokenizer object.
_TOKENIZERS: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def ll_tokenizer(tokenizer: Any, vocab_size: int) -> Any:
    """llguidance's view of `tokenizer` (an mlx-lm TokenizerWrapper or a Hugging Face fast tokenizer)."""
    cached = _TOKENIZERS.get(tokenizer)
    if cached is not None and cached[0] == vocab_size:
        return cached[1]
    import llguidance.hf
    import transformers

    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    if not isinstance(hf, transformers.PreTrainedTokenizerFast):
        raise ConstraintError("tokenizer", f"constrained decoding needs a fast (tokenizers-backed) tokenizer, got {type(hf).__name__}")
    eos = sorted(getattr(tokenizer, "eos_token_ids", None) or [hf.eos_token_id])
    if len(hf) > vocab_size:
        raise ConstraintError("tokenizer", f"the tokenizer has {len(hf)} tokens but the model's vocabulary is {vocab_size}")
    lltok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size, eos_token=eos)
    try:
        _TOKENIZERS[tokenizer] = (vocab_size, lltok)
    except TypeError:  # not weak-referenceable: no cache
        pass
    return lltok


def compile_constraint(constraint: Constraint, tokenizer: Any, vocab_size: int) -> Any:
    """A fresh `grammar.GrammarState` for one request; ConstraintError if the grammar is refused."""
    from mlx_dspark.engine.logits.grammar import GrammarState

    lltok = ll_tokenizer(tokenizer, vocab_size)
    llg = _llg()
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(constraint.grammar, lltok)
    if is_error:
        raise ConstraintError(constraint.kind, messages[0] if messages else "the grammar engine refused it")
    matcher = llg.LLMatcher(lltok, constraint.grammar, log_level=0)
    if matcher.is_error():
        raise ConstraintError(constraint.kind, matcher.get_error())
    state = GrammarState(matcher, vocab_size=vocab_size, eos_ids=tuple(lltok.eos_tokens if hasattr(lltok, "eos_tokens") else [lltok.eos_token]))
    if not state.can_start():
        raise ConstraintError(constraint.kind, "it matches no text this tokenizer can write (no first token is allowed)")
    return state
