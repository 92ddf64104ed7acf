"""The model's own tokenizer, built from a GGUF file's tokenizer metadata.

Two vocabulary kinds are understood, as llama.cpp reads them:
``llama`` (SentencePiece: word pieces with scores, "▁" for spaces, byte
tokens "<0xAB>") and ``gpt2`` (byte-level BPE with merges, after the
pre-tokenizer ``tokenizer.ggml.pre`` names). Merging is done by the
``tokenizers`` library; this module decides what it merges.

Control tokens (token type 3, such as ``<|im_start|>``) are never produced by
merging. ``encode(text, specials=True)`` turns their exact text into their
ids; with ``specials=False`` all text is plain. A control token's text with
the character ``inert`` inside it is no control token: the character is
removed and the text tokenized as plain text. That is how text from a chat
message keeps a control token's text as text (see ChatTemplate.render).
"""

import abc
import functools
import re
from typing import Callable, Iterable, Optional, Sequence

import numpy as np
import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors

from .gguf_file import BadModelFile, GGUFFile

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Control tokens that end a turn in every model that has them (as llama.cpp treats them).
END_OF_GENERATION = frozenset({
    "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<EOT>",
    "<|end_of_text|>", "<｜end▁of▁sentence｜>", "<|return|>", "<|call|>",
})

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# tokenizer.ggml.pre -> (regexes applied one after another, whole words skip merging, BOS by default)
PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool, bool]] = {
    "default": ((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"), False, False),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"), ((_LLAMA3,), True, True)),
    **dict.fromkeys(("dbrx", "smaug-bpe"), ((_LLAMA3,), False, False)),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
                    ((r"\p{N}", _GPT2), False, False)),
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo", "jais"), ((_GPT2,), False, False)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"), ((_QWEN2,), False, False)),
    "tekken": ((_TEKKEN,), True, True),
    "falcon": ((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"), False, False),
}


def any_of(texts: Iterable[str]) -> Optional[re.Pattern]:
    """A pattern that finds any of ``texts``, the longest where several start at one place; None for none."""
    by_length = sorted(texts, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, by_length))) if by_length else None


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: which byte each printable character stands for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


def byte_level_bytes(text: str) -> Optional[bytes]:
    """The bytes a byte-level token stands for; None if ``text`` is not byte-level."""
    table = _byte_decoder()
    try:
        return bytes(table[c] for c in text)
    except KeyError:
        return None


def _spm_merges(tokens: list[str], scores: Sequence[float], types: Sequence[int]) -> list[tuple[str, str]]:
    """SentencePiece's greedy merging as BPE merges: each piece from its halves, best score first."""
    ids = {t: i for i, t in enumerate(tokens) if types[i] in (NORMAL, USER_DEFINED)}
    merges = []
    for piece, i in ids.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                merges.append((-float(scores[i]), ids[left], ids[right], left, right))
    merges.sort()
    return [(left, right) for *_, left, right in merges]


class Tokenizer(abc.ABC):
    """Text to token ids and back; what every engine's model is tokenized with."""

    vocab_size: int
    bos_id: Optional[int]
    eos_id: Optional[int]
    add_bos: bool  # prompts start with BOS
    add_eos: bool  # prompts end with EOS
    sep_id: Optional[int] = None
    add_sep: bool = False  # a pair of texts (a query and a document) has SEP between them
    end_ids: frozenset[int]  # tokens that end generation
    control: dict[str, int]  # control tokens by their text
    longest_piece: int  # bytes of the longest token
    fim_ids: dict[str, int] = {}  # fill-in-the-middle tokens by role: pre, suf, mid, rep, sep (those the file has)

    @abc.abstractmethod
    def encode(self, text: str, specials: bool = True, inert: Optional[str] = None) -> list[int]:
        """Token ids of ``text`` (no BOS added); see the module docstring for ``specials`` and ``inert``."""

    @abc.abstractmethod
    def piece(self, token: int) -> bytes:
        """The bytes one generated token adds to the text."""

    @abc.abstractmethod
    def decode(self, tokens: Sequence[int]) -> bytes:
        """The text ``prompt`` made these tokens from: control tokens as their text, but not an added BOS or EOS."""

    @abc.abstractmethod
    def token_text(self, token: Optional[int]) -> str:
        """A token's text as the vocabulary spells it (for templates' bos_token and eos_token)."""

    def continuation(self, text: str) -> list[int]:
        """Token ids of plain ``text`` that continues earlier text (SentencePiece puts no space before it)."""
        return self.encode(text, specials=False)

    def fewest_tokens(self, text: str) -> int:
        """A floor on the tokens ``text`` becomes, found without tokenizing it (which takes seconds for megabytes)."""
        return -(-len(text.encode("utf-8", "surrogatepass")) // self.longest_piece)

    def prompt(self, text: str, specials: bool = True, inert: Optional[str] = None) -> list[int]:
        """Token ids of a whole prompt: BOS (unless the text already starts with it) and EOS as the file asks."""
        ids = self.encode(text, specials, inert)
        if self.add_bos and ids[:1] != [self.bos_id]:
            ids.insert(0, self.bos_id)
        if self.add_eos and ids[-1:] != [self.eos_id]:
            ids.append(self.eos_id)
        return ids

    def pair(self, first: str, second: str) -> list[int]:
        """Token ids of two texts read together (a reranker's query and document), laid out as llama.cpp lays them
        out for a file without a prompt of its own: [BOS] first [EOS] [SEP] second [EOS], each as the file asks;
        the texts' control tokens are plain text."""
        bos = [self.bos_id] if self.add_bos else []
        eos = [self.eos_id] if self.add_eos else []
        sep = [self.sep_id] if self.add_sep else []
        return bos + self.encode(first, specials=False) + eos + sep + self.encode(second, specials=False) + eos


# Fill-in-the-middle tokens by role, by the texts llama.cpp knows them by where a file's metadata names none.
FIM_TEXTS = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>", "<|code_prefix|>",
            "<|prefix|>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>", "<|code_suffix|>",
            "<|suffix|>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>", "<|code_middle|>",
            "<|middle|>"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>",),
}


def _fim_ids(tokens: list[str], special: Callable[[str], Optional[int]]) -> dict[str, int]:
    """The fill-in-the-middle tokens a vocabulary has, by role: as its metadata names them, else by their texts."""
    wanted = {text for texts in FIM_TEXTS.values() for text in texts}
    found = {text: i for i, text in enumerate(tokens) if text in wanted}
    ids = {}
    for role, texts in FIM_TEXTS.items():
        named = special(f"fim_{role}_token_id")
        if named is None:
            named = next((found[text] for text in texts if text in found), None)
        if named is not None:
            ids[role] = named
    return ids


def control_tokens(gguf_file: GGUFFile) -> dict[str, int]:
    """A file's control tokens by their text, read from its metadata alone (building its tokenizer takes seconds
    for a large vocabulary)."""
    tokens = gguf_file.get("tokenizer.ggml.tokens") or []
    types = gguf_file.get("tokenizer.ggml.token_type")
    if types is None:
        return {}
    return {tokens[i]: int(i) for i in np.flatnonzero(np.asarray(types) == CONTROL) if i < len(tokens)}


class PipelineTokenizer(Tokenizer):
    """A vocabulary of typed token texts whose plain text a ``tokenizers`` pipeline merges and whose control tokens
    are found by their text: what a tokenizer read from a GGUF file and one read from a ``tokenizer.json`` share."""

    kind: str  # "llama": SentencePiece's "▁" for spaces and byte tokens "<0xAB>"; "gpt2": byte-level BPE
    space_prefix: bool  # a space is put before the text (SentencePiece)
    texts: list[str]
    types: list[int]
    _hf: tokenizers.Tokenizer  # merges plain text
    _hf_continued: tokenizers.Tokenizer  # merges plain text that continues earlier text

    def _vocabulary(self, texts: list[str], types: list[int], special: Callable[[str], Optional[int]],
                    ends: Iterable[Optional[int]]) -> None:
        """What follows from the token texts and types (``kind``, ``space_prefix``, ``eos_id`` set first): the
        control, end and fill-in-the-middle tokens, each token's bytes. ``special`` names a token by its role
        (``bos_token_id``...) where the source does, ``ends`` are the source's end tokens beside EOS."""
        self.texts, self.types = texts, types
        self.vocab_size = len(texts)
        self.control = {texts[i]: i for i, kind in enumerate(types) if kind == CONTROL}
        self._control_pattern = any_of(self.control)
        ends = {self.eos_id, *ends} | {i for text, i in self.control.items() if text in END_OF_GENERATION}
        if {"<|return|>", "<|call|>"} <= self.control.keys():  # gpt-oss: <|end|> ends a message, not the reply
            ends.discard(self.control.get("<|end|>"))
        self.end_ids = frozenset(i for i in ends if i is not None)
        self.fim_ids = _fim_ids(texts, special)
        self._pieces = [self._piece_bytes(i) for i in range(len(texts))]
        self.longest_piece = max(4, max((len(t.encode("utf-8", "surrogateescape")) for t in texts), default=0))

    def _piece_bytes(self, token: int) -> bytes:
        """The bytes a token stands for in generated text; control tokens stand for none."""
        text, kind = self.texts[token], self.types[token]
        if kind in (CONTROL, UNKNOWN, UNUSED):
            return b""
        if kind == BYTE and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", text):
            return bytes([int(text[3:5], 16)])
        if kind == NORMAL and self.kind == "gpt2":
            raw = byte_level_bytes(text)
            if raw is not None:
                return raw
        if self.kind == "llama":
            text = text.replace("▁", " ")
        return text.encode("utf-8", "surrogateescape")

    def token_text(self, token: Optional[int]) -> str:
        return "" if token is None else self.texts[token]

    def encode(self, text: str, specials: bool = True, inert: Optional[str] = None) -> list[int]:
        if not specials or self._control_pattern is None:
            return self._plain(text, inert)
        ids: list[int] = []
        at = 0
        for match in self._control_pattern.finditer(text):
            ids += self._plain(text[at:match.start()], inert)
            ids.append(self.control[match.group()])
            at = match.end()
        return ids + self._plain(text[at:], inert)

    def _plain(self, text: str, inert: Optional[str]) -> list[int]:
        if inert:
            text = text.replace(inert, "")
        # encode_batch lets go of the GIL while it works (encode does not): the event loop runs on meanwhile.
        return self._hf.encode_batch([text], add_special_tokens=False)[0].ids if text else []

    def continuation(self, text: str) -> list[int]:
        return self._hf_continued.encode_batch([text], add_special_tokens=False)[0].ids if text else []

    def piece(self, token: int) -> bytes:
        return self._pieces[token]

    def decode(self, tokens: Sequence[int]) -> bytes:
        tokens = list(tokens)
        if self.add_bos and tokens[:1] == [self.bos_id]:
            tokens = tokens[1:]
        if self.add_eos and tokens[-1:] == [self.eos_id]:
            tokens = tokens[:-1]
        data = b"".join(
            self.texts[t].encode("utf-8", "surrogateescape") if self.types[t] == CONTROL else self._pieces[t]
            for t in tokens
        )
        # SentencePiece puts a space before the text it tokenizes; its decode leaves it out.
        return data[1:] if self.space_prefix and data.startswith(b" ") else data


class GGUFTokenizer(PipelineTokenizer):
    """The tokenizer a GGUF file describes, exactly as the model was trained."""

    def __init__(self, gguf_file: GGUFFile) -> None:
        get = gguf_file.get
        self.kind = get("tokenizer.ggml.model")
        tokens: list[str] = get("tokenizer.ggml.tokens") or []
        if not tokens:
            raise BadModelFile(f"{gguf_file.path.name}: no vocabulary (tokenizer.ggml.tokens)")
        types = get("tokenizer.ggml.token_type")
        types = [int(t) for t in types] if types is not None else [NORMAL] * len(tokens)
        self.pre = get("tokenizer.ggml.pre")
        if self.kind == "llama":
            model, normalizer, pre_tokenizer, add_bos = self._spm(gguf_file, tokens, types)
        elif self.kind == "gpt2":
            model, normalizer, pre_tokenizer, add_bos = self._bpe(gguf_file, tokens, types)
        else:
            raise BadModelFile(f"{gguf_file.path.name}: vocabulary kind {self.kind!r} is not supported (llama and gpt2 are)")
        user_defined = [tokenizers.AddedToken(tokens[i], normalized=False, special=False)
                        for i, kind in enumerate(types) if kind == USER_DEFINED]
        self._hf = self._pipeline(model, normalizer, pre_tokenizer, user_defined)
        self._hf_continued = self._hf
        if self.space_prefix:
            inner = normalizers.Replace(" ", "▁")
            self._hf_continued = self._pipeline(model, inner, pre_tokenizer, user_defined)

        def special(key: str) -> Optional[int]:
            value = get(f"tokenizer.ggml.{key}")
            return int(value) if value is not None and 0 <= int(value) < len(tokens) else None

        self.bos_id = special("bos_token_id")
        self.eos_id = special("eos_token_id")
        self.add_bos = bool(get("tokenizer.ggml.add_bos_token", add_bos)) and self.bos_id is not None
        self.add_eos = bool(get("tokenizer.ggml.add_eos_token", False)) and self.eos_id is not None
        self.sep_id = special("seperator_token_id")  # GGUF's spelling
        self.add_sep = bool(get("tokenizer.ggml.add_sep_token", False)) and self.sep_id is not None
        self._vocabulary(tokens, types, special, (special("eot_token_id"), special("eom_token_id")))

    @staticmethod
    def _pipeline(model, normalizer, pre_tokenizer, added: list[tokenizers.AddedToken]) -> tokenizers.Tokenizer:
        pipeline = tokenizers.Tokenizer(model)
        if normalizer is not None:
            pipeline.normalizer = normalizer
        if pre_tokenizer is not None:
            pipeline.pre_tokenizer = pre_tokenizer
        pipeline.add_tokens(added)
        return pipeline

    def to_json(self) -> str:
        """This tokenizer as a ``tokenizer.json`` that the ``tokenizers`` library (and any client built on it, such
        as a gateway that tokenizes for its workers) reads to the same ids: control tokens as special tokens,
        BOS and EOS added as prompts get them, and a decoder back to the text."""
        pipeline = tokenizers.Tokenizer.from_str(self._hf.to_str())
        pipeline.add_special_tokens([tokenizers.AddedToken(text, normalized=False, special=True)
                                     for text in sorted(self.control, key=self.control.get)])
        if self.kind == "gpt2":
            pipeline.decoder = decoders.ByteLevel()
        else:
            steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
            pipeline.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if self.space_prefix else []))
        added = [i for i, adds in ((self.bos_id, self.add_bos), (self.eos_id, self.add_eos)) if adds]
        if added:
            single = [self.texts[self.bos_id]] * self.add_bos + ["$A"] + [self.texts[self.eos_id]] * self.add_eos
            pipeline.post_processor = processors.TemplateProcessing(
                single=single, special_tokens=[(self.texts[i], i) for i in added])
        return pipeline.to_str()

    def _spm(self, gguf_file: GGUFFile, tokens: list[str], types: list[int]):
        scores = gguf_file.get("tokenizer.ggml.scores")
        if scores is None:
            raise BadModelFile(f"{gguf_file.path.name}: a llama vocabulary needs tokenizer.ggml.scores")
        unk = next((tokens[i] for i, kind in enumerate(types) if kind == UNKNOWN), None)
        model = models.BPE(
            vocab={t: i for i, t in enumerate(tokens)}, merges=_spm_merges(tokens, scores, types),
            byte_fallback=True, unk_token=unk,
        )
        self.space_prefix = bool(gguf_file.get("tokenizer.ggml.add_space_prefix", True))
        steps = [normalizers.Prepend("▁")] if self.space_prefix else []
        return model, normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")]), None, True

    def _bpe(self, gguf_file: GGUFFile, tokens: list[str], types: list[int]):
        merges = []
        for merge in gguf_file.get("tokenizer.ggml.merges") or []:
            cut = merge.find(" ", 1)
            if cut > 0:
                merges.append((merge[:cut], merge[cut + 1:]))
        pre = self.pre or "default"
        if pre not in PRE_TOKENIZERS:
            raise BadModelFile(f"{gguf_file.path.name}: pre-tokenizer {pre!r} is not supported")
        regexes, ignore_merges, add_bos = PRE_TOKENIZERS[pre]
        model = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, ignore_merges=ignore_merges)
        steps = [pre_tokenizers.Split(tokenizers.Regex(r), behavior="isolated") for r in regexes]
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
        self.space_prefix = False
        return model, None, pre_tokenizers.Sequence(steps), add_bos
