"""A model's tokenizer read from Hugging Face's tokenizer files: ``tokenizer.json`` (run by the ``tokenizers``
library), with ``tokenizer_config.json`` (BOS, EOS, the chat template, unless ``chat_template.jinja`` or
``chat_template.json`` has it), ``config.json`` and
``generation_config.json`` (the end tokens, the vocabulary's size, the context length), as a folder holds them
or as a gRPC worker's ``GetTokenizer`` bundle (a zip) carries them.

The vocabulary is typed as a GGUF file's is: the special added tokens are
control tokens (found by their text, as ``PipelineTokenizer`` finds them), the
other added tokens user-defined, ``<0xAB>`` byte tokens where the model falls
back to bytes. A byte-level pipeline (GPT-2's ``ByteLevel``) is the ``gpt2``
kind, any other the ``llama`` kind (SentencePiece's "▁").
"""

import io
import json
import zipfile
from pathlib import Path
from typing import Any, Optional

import tokenizers

from .gguf_file import BadModelFile
from .tokenizer import BYTE, CONTROL, NORMAL, UNKNOWN, UNUSED, USER_DEFINED, PipelineTokenizer

FILES = ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json", "chat_template.json",
         "chat_template.jinja")
# A model_max_length this large is transformers' "no limit", not a context length.
NO_LIMIT = 10 ** 8


class HFTokenizer(PipelineTokenizer):
    """The tokenizer ``tokenizer.json`` describes, with the special tokens its companion files name."""

    def __init__(self, files: dict[str, str], source: str) -> None:
        if "tokenizer.json" not in files:
            raise BadModelFile(f"{source}: no tokenizer.json")
        try:
            spec = json.loads(files["tokenizer.json"])
            config, model_config, generation, template = (json.loads(files.get(name) or "{}") for name in FILES[1:5])
        except ValueError as exc:
            raise BadModelFile(f"{source}: a tokenizer file is not JSON: {exc}") from None
        model = spec.get("model") or {}
        if model.get("type") not in ("BPE", "Unigram"):
            raise BadModelFile(f"{source}: a {model.get('type')} tokenizer is not supported (BPE and Unigram are)")
        added = spec.get("added_tokens") or []
        vocab = model["vocab"] if model["type"] == "BPE" else {piece: i for i, (piece, _) in enumerate(model["vocab"])}
        size = max([len(vocab), int(model_config.get("vocab_size") or 0), *(t["id"] + 1 for t in added)])
        texts, types = [""] * size, [UNUSED] * size
        for text, i in vocab.items():
            texts[i], types[i] = text, NORMAL
        self.kind = "gpt2" if _has(spec.get("pre_tokenizer"), "ByteLevel") or _has(spec.get("decoder"), "ByteLevel") \
            else "llama"
        if self.kind == "llama" and model.get("byte_fallback"):
            for i, text in enumerate(texts):
                if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
                    types[i] = BYTE
        unknown = model.get("unk_token") if model["type"] == "BPE" else model.get("unk_id")
        if isinstance(unknown, str) and unknown in vocab:
            types[vocab[unknown]] = UNKNOWN
        elif isinstance(unknown, int) and 0 <= unknown < size:
            types[unknown] = UNKNOWN
        for token in added:
            texts[token["id"]], types[token["id"]] = token["content"], CONTROL if token.get("special") else USER_DEFINED
        self._hf, self._hf_continued, self.space_prefix = _pipelines(spec)
        ids = {text: i for i, text in enumerate(texts) if types[i] != UNUSED}
        self.bos_id, self.eos_id = (ids.get(_token_text(config.get(name))) for name in ("bos_token", "eos_token"))
        self.add_bos = bool(config.get("add_bos_token", _processor_adds(spec, texts, self.bos_id, first=True))) \
            and self.bos_id is not None
        self.add_eos = bool(config.get("add_eos_token", _processor_adds(spec, texts, self.eos_id, first=False))) \
            and self.eos_id is not None
        ends = [*_ids(model_config.get("eos_token_id")), *_ids(generation.get("eos_token_id"))]
        self._vocabulary(texts, types, lambda role: None, (i for i in ends if 0 <= i < size))
        self.chat_template = (files.get("chat_template.jinja") or _template(template.get("chat_template"))
                              or _template(config.get("chat_template")))
        self.model_vocab_size = model_config.get("vocab_size")  # the model's, where config.json says it
        windows = [model_config.get("max_position_embeddings"), config.get("model_max_length")]
        self.context_length = next((int(w) for w in windows if isinstance(w, (int, float)) and 0 < w < NO_LIMIT), None)

    @classmethod
    def from_folder(cls, folder: Path) -> "HFTokenizer":
        files = {name: (folder / name).read_text(encoding="utf-8") for name in FILES if (folder / name).is_file()}
        return cls(files, str(folder))

    @classmethod
    def from_bundle(cls, data: bytes, source: str) -> "HFTokenizer":
        """From a zip of the files (at its top or in one folder of it)."""
        try:
            with zipfile.ZipFile(io.BytesIO(data)) as archive:
                files = {Path(name).name: archive.read(name).decode("utf-8") for name in archive.namelist()
                         if Path(name).name in FILES}
        except (zipfile.BadZipFile, UnicodeDecodeError) as exc:
            raise BadModelFile(f"{source}: the tokenizer bundle cannot be read: {exc}") from None
        return cls(files, source)


def _has(step: Optional[dict], kind: str) -> bool:
    """Whether a pipeline step (or a Sequence of them) is of ``kind``."""
    if not step:
        return False
    inner = step.get("pretokenizers") or step.get("decoders") or step.get("normalizers") or ()
    return step.get("type") == kind or any(_has(part, kind) for part in inner)


def _pipelines(spec: dict) -> tuple[tokenizers.Tokenizer, tokenizers.Tokenizer, bool]:
    """The pipeline for plain text (the special tokens left to the control tokens' pattern, nothing added around
    it), one for text that continues earlier text (no space put before it), and whether a space is put before."""
    plain = {**spec, "added_tokens": [t for t in spec.get("added_tokens") or [] if not t.get("special")],
             "post_processor": None}
    plain_text = json.dumps(plain)
    continued = json.loads(plain_text)  # a copy to change
    prefixed = _drop_prefix(continued)
    return (tokenizers.Tokenizer.from_str(plain_text), tokenizers.Tokenizer.from_str(json.dumps(continued)),
            prefixed)


def _drop_prefix(spec: dict) -> bool:
    """Take out of ``spec`` what puts a space ("▁") before the text: a normalizer's Prepend, a Metaspace's
    prepend scheme; whether there was one."""
    found = False
    normalizer = spec.get("normalizer")
    if normalizer and normalizer.get("type") == "Prepend":
        spec["normalizer"], found = None, True
    elif normalizer and normalizer.get("type") == "Sequence":
        steps = normalizer["normalizers"]
        kept = [step for step in steps if step.get("type") != "Prepend"]
        found, normalizer["normalizers"] = len(kept) < len(steps), kept
    pre = spec.get("pre_tokenizer")
    for step in [pre, *((pre or {}).get("pretokenizers") or ())]:
        if step and step.get("type") == "Metaspace" and (step.get("prepend_scheme", "always") != "never"
                                                         or step.get("add_prefix_space")):
            step["prepend_scheme"], step["add_prefix_space"], found = "never", False, True
    return found


def _token_text(value: Any) -> Optional[str]:
    """A token named in tokenizer_config.json: its text, or an added token's record."""
    return value.get("content") if isinstance(value, dict) else value


def _ids(value: Any) -> list[int]:
    return [value] if isinstance(value, int) else [i for i in value or () if isinstance(i, int)]


def _processor_adds(spec: dict, texts: list[str], token: Optional[int], first: bool) -> bool:
    """Whether the post-processor puts ``token`` first (or last) in a single text's ids."""
    processor = spec.get("post_processor") or {}
    steps = processor.get("processors") or [processor]
    for step in steps:
        single = step.get("single") if step.get("type") == "TemplateProcessing" else None
        if single and token is not None:
            end = single[0] if first else single[-1]
            return (end.get("SpecialToken") or {}).get("id") == texts[token]
    return False


def _template(value: Any) -> Optional[str]:
    """tokenizer_config.json's chat template: one text, or the one named "default" of several."""
    if isinstance(value, list):
        return next((t.get("template") for t in value if isinstance(t, dict) and t.get("name") == "default"), None)
    return value if isinstance(value, str) and value else None
