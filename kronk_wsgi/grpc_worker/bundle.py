"""The tokenizer bundle a gateway asks a worker for (``GetTokenizer``): a zip of Hugging Face tokenizer files.

Made from the loaded model: ``tokenizer.json`` tokenizes exactly as this
server does (see ``GGUFTokenizer.to_json``), ``tokenizer_config.json``
carries the chat template the server renders and the special tokens, and
``config.json`` the end tokens and the context length.
"""

import hashlib
import io
import json
import zipfile
from typing import Iterable

from ..engine.tokenizer import Tokenizer
from ..serving.pool import LoadedModel

CHUNK_BYTES = 64 * 1024  # per GetTokenizerChunk, as the gateway reads them


def tokenizer_bundle(model: LoadedModel) -> tuple[bytes, str]:
    """The zip's bytes and their SHA-256 (hex); ValueError if the model's tokenizer cannot be written out."""
    if getattr(model.engine.tokenizer, "to_json", None) is None:
        raise ValueError(f"the {model.engine.kind.name} engine's tokenizer cannot be written as tokenizer.json")
    files = tokenizer_files(model.engine.tokenizer, model.template.source, model.end_ids, model.engine.context_length)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, text in files.items():
            archive.writestr(name, text)
    data = buffer.getvalue()
    return data, hashlib.sha256(data).hexdigest()


def tokenizer_files(tokenizer: Tokenizer, template: str, end_ids: Iterable[int], context_length: int) -> dict[str, str]:
    """The bundle's files by name, for a tokenizer that has ``to_json``."""
    bos, eos = tokenizer.token_text(tokenizer.bos_id), tokenizer.token_text(tokenizer.eos_id)
    ends = sorted(end_ids)
    return {
        "tokenizer.json": tokenizer.to_json(),
        "tokenizer_config.json": json.dumps({
            "chat_template": template, "bos_token": bos or None, "eos_token": eos or None,
            "add_bos_token": tokenizer.add_bos, "add_eos_token": tokenizer.add_eos,
            "model_max_length": context_length, "tokenizer_class": "PreTrainedTokenizerFast",
        }),
        "config.json": json.dumps({
            "bos_token_id": tokenizer.bos_id, "eos_token_id": ends, "vocab_size": tokenizer.vocab_size,
            "max_position_embeddings": context_length,
        }),
        "generation_config.json": json.dumps({"bos_token_id": tokenizer.bos_id, "eos_token_id": ends}),
    }
