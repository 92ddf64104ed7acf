"""Constrained decoding: which tokens may come next so the text stays inside a grammar.

llguidance does the work: it compiles JSON Schema or Lark grammars and, at
each step, gives the set of tokens that keep the text a possible prefix of the
grammar, for the model's own tokenizer (wrapped once per model). A grammar is
compiled once per request, before the commit, so a schema it cannot take is a
400; each reply then walks a copy of it.
"""

import functools
import json
from typing import Any, Mapping, Optional

import llguidance
from llguidance.gbnf_to_lark import is_lark_syntax
import numpy as np

from .tokenizer import Tokenizer

# How the JSON is written: compact, with the spaces json.dumps puts (what models have seen most).
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# The longest GBNF text taken: its conversion (Python, holding the GIL) grows faster than the text, about 1 s at
# 28 KB of nested rules; llama.cpp's own grammars are a few KB.
MAX_GBNF_BYTES = 32_000
LARGEST_WRITTEN = 10**16 - 1  # an unbounded integer's largest value: 16 digits


def _limits() -> llguidance.LLParserLimits:
    """llguidance's default limits, with errors that never quote the grammar (a client's text, in the log)."""
    return llguidance.LLParserLimits(verbose_errors=False)


class GrammarError(ValueError):
    """A grammar or schema the constraint engine cannot take."""


class _Vocabulary:
    """The model's tokenizer as llguidance reads it: every token's bytes, control tokens marked with 0xFF."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self.special_token_ids = sorted(tokenizer.control.values())
        control = set(self.special_token_ids)
        self.tokens = [
            b"\xff" + tokenizer.token_text(i).encode("utf-8", "surrogateescape") if i in control else tokenizer.piece(i)
            for i in range(tokenizer.vocab_size)
        ]

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):  # llguidance then hands over text instead of bytes
            raise TypeError("text only")
        return self._tokenizer.continuation(text)


@functools.lru_cache(maxsize=8)
def _ll_tokenizer(tokenizer: Tokenizer, end_ids: frozenset[int]) -> llguidance.LLTokenizer:
    """The llguidance tokenizer for a model's tokenizer and end tokens (0.1-1 s to build, so built once)."""
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocabulary(tokenizer)), eos_token=sorted(end_ids))


def bounded_integers(schema: Any) -> Any:
    """``schema`` with every integer that has no bound of its own held to 16 digits, as llama.cpp's JSON grammar
    holds them: a small model can otherwise write digits until its token limit."""
    if isinstance(schema, list):
        return [bounded_integers(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    bounded = {key: value if key in ("const", "enum", "default", "examples") else bounded_integers(value)
               for key, value in schema.items()}
    types = schema.get("type")
    if types == "integer" or (isinstance(types, list) and "integer" in types):
        if "minimum" not in schema and "exclusiveMinimum" not in schema:
            bounded["minimum"] = -LARGEST_WRITTEN
        if "maximum" not in schema and "exclusiveMaximum" not in schema:
            bounded["maximum"] = LARGEST_WRITTEN
    return bounded


def json_schema_grammar(schema: dict[str, Any], lenient: bool = False) -> str:
    """A grammar for JSON that validates against ``schema``; ``lenient`` skips keywords it cannot enforce."""
    options = {**JSON_STYLE, "lenient": lenient}
    return llguidance.LLMatcher.grammar_from_json_schema(bounded_integers(schema), defaults=options)


def lark_json(schema: dict[str, Any], lenient: bool = False) -> str:
    """A Lark expression for JSON valid against ``schema``, to use inside a larger Lark grammar."""
    options = {**JSON_STYLE, "lenient": lenient}
    return "%json " + json.dumps({**bounded_integers(schema), "x-guidance": options}, ensure_ascii=False)


def ebnf_grammar(text: str) -> str:
    """A grammar from EBNF text, as llguidance tells the two apart: Lark (from ``%llguidance`` or a ``start:``
    rule), or llama.cpp's GBNF (as llama-server's ``grammar`` field takes it); GrammarError if it does not
    convert, or is GBNF longer than MAX_GBNF_BYTES (Lark is compiled without a conversion)."""
    if is_lark_syntax(text):
        return lark_grammar(text)
    if len(text.encode("utf-8", "surrogatepass")) > MAX_GBNF_BYTES:
        raise GrammarError(f"it is longer than {MAX_GBNF_BYTES} bytes")
    try:
        return llguidance.grammar_from("gbnf", text)
    except ValueError as exc:
        raise GrammarError(str(exc)) from None


def lark_grammar(lark: str) -> str:
    try:
        return llguidance.LLMatcher.grammar_from_lark(lark)
    except ValueError as exc:
        raise GrammarError(str(exc)) from None


def lark_after(tag: str, lark: str, control: Mapping[str, int]) -> str:
    """A Lark grammar of a whole reply held as a reply decoded with ``constrain_after`` is held here: free text
    until it writes ``tag`` (as text, or as the control token it is), then ``lark``, a grammar of one rule,
    ``start`` (as the calls' grammars and a JSON Schema's made here are)."""
    if not lark.startswith("start:") or "\n" in lark.rstrip("\n"):
        raise ValueError("the grammar held after a tag is one rule, start")
    written = f"/(?s:.*){regex_literal(tag)}/"
    tagged = "kronk_written" + (f" | KRONK_FREE <[{control[tag]}]>" if tag in control else "")
    return ("%llguidance {}\n"
            "start: KRONK_FREE | kronk_tag kronk_held\n"
            f"kronk_tag: {tagged}\n"
            f"kronk_written[lazy]: {written}\n"  # ends where the tag is first written
            f"KRONK_FREE: /(?s:.*)/ & ~/(?s:.*){regex_literal(tag)}(?s:.*)/\n"  # text that never writes it
            "kronk_held:" + lark.removeprefix("start:"))


def regex_literal(text: str) -> str:
    """``text`` matched as it is, inside a Lark regex."""
    return "".join("\\" + c if c in r"\.^$|?*+()[]{}/-" else "\\n" if c == "\n" else c for c in text)


def lark_string(text: str) -> str:
    """``text`` as a Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


class Grammar:
    """A compiled grammar for one model; ``constraint()`` starts a reply inside it.

    The reply may end (with one of ``end_ids``) where the grammar is matched in full. ``origin`` is the
    whole reply's constraint as an engine elsewhere takes it: ("json_schema", a schema's JSON), ("ebnf_grammar",
    GBNF text) or ("lark", Lark text, held from a tag on if the reply is); None where it cannot be sent.
    """

    def __init__(self, tokenizer: Tokenizer, end_ids: frozenset[int], grammar: str,
                 origin: Optional[tuple[str, str]] = None) -> None:
        self.origin = origin
        self._ll_tokenizer = _ll_tokenizer(tokenizer, end_ids)
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self._ll_tokenizer,
                                                                               limits=_limits())
        if failed:
            raise GrammarError(messages[0])
        self._matcher = llguidance.LLMatcher(self._ll_tokenizer, grammar, log_level=0, limits=_limits())
        if self._matcher.is_error():
            raise GrammarError(self._matcher.get_error())
        self.vocab_size = tokenizer.vocab_size
        self.constraint().allowed()  # the first step's limits are met before the commit, or it is a 400

    def constraint(self) -> "Constraint":
        return Constraint(self._matcher.deep_copy(), self.vocab_size)


class Constraint:
    """One reply's walk through a grammar: the tokens allowed next, and the tokens taken."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._mask = np.zeros((vocab_size + 31) // 32, dtype=np.int32)

    def allowed(self) -> np.ndarray:
        """A boolean array over the vocabulary: the tokens that keep the text inside the grammar."""
        self._matcher.unsafe_compute_mask_ptr(self._mask.ctypes.data, self._mask.nbytes)
        if self._matcher.is_error():
            raise GrammarError(self._matcher.get_error())
        return np.unpackbits(self._mask.view(np.uint8), bitorder="little")[: self._vocab_size].astype(bool)

    def take(self, token: int) -> None:
        """Move past ``token`` (one of the allowed ones)."""
        if not self._matcher.consume_token(token):
            raise GrammarError(self._matcher.get_error())

    @property
    def complete(self) -> bool:
        """Nothing may follow: the grammar is matched in full."""
        return self._matcher.is_stopped()
