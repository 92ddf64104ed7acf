"""A tokenizer read from Hugging Face's files (as a gRPC worker's GetTokenizer bundle or a folder carries them)
tokenizes, decodes and names its special tokens exactly as the GGUF file it was written from: SentencePiece
(the tiny model, Gemma 3) and byte-level BPE (SmolLM2)."""

import io
import json
import zipfile

import pytest

from kronk_wsgi.engine.gguf_file import BadModelFile, read_gguf
from kronk_wsgi.engine.hf_tokenizer import HFTokenizer
from kronk_wsgi.engine.tokenizer import GGUFTokenizer
from kronk_wsgi.grpc_worker.bundle import tokenizer_files

from .test_grpc_worker import HARD_TEXTS

TEXTS = [*HARD_TEXTS, "<bos>x", "hello<end_of_turn>\n", "</s> <s>", "▁ spaced ▁"]


def written(path):
    """The GGUF file's tokenizer, and the files a worker's bundle carries for it."""
    model = read_gguf(path)
    tokenizer = GGUFTokenizer(model)
    return tokenizer, model, tokenizer_files(tokenizer, model.chat_template or "", tokenizer.end_ids, 4096)


@pytest.fixture(scope="module", params=["tiny_model", "smollm2", "gemma3"])
def pair(request):
    tokenizer, model, files = written(request.getfixturevalue(request.param))
    return tokenizer, model, HFTokenizer(files, request.param)


def test_it_tokenizes_and_decodes_as_the_file(pair):
    ours, _, read = pair
    for text in TEXTS:
        assert read.prompt(text) == ours.prompt(text), text
        assert read.encode(text, specials=False) == ours.encode(text, specials=False), text
        assert read.continuation(text) == ours.continuation(text), text
        assert read.encode(text, inert="\u2060") == ours.encode(text, inert="\u2060"), text
        assert read.decode(read.prompt(text)) == ours.decode(ours.prompt(text)), text
    assert [read.piece(i) for i in range(read.vocab_size)] == [ours.piece(i) for i in range(ours.vocab_size)]


def test_it_names_the_special_tokens_the_template_and_the_window_as_the_file(pair):
    ours, model, read = pair
    for name in ("vocab_size", "bos_id", "eos_id", "add_bos", "add_eos", "end_ids", "control", "fim_ids",
                 "longest_piece", "kind", "space_prefix"):
        assert getattr(read, name) == getattr(ours, name), name
    assert read.chat_template == (model.chat_template or None) and read.context_length == 4096
    assert read.model_vocab_size == ours.vocab_size


def test_a_bundle_is_read_from_its_zip_and_a_folder_from_its_files(smollm2, tmp_path):
    ours, _, files = written(smollm2)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, text in files.items():
            archive.writestr(f"SmolLM2/{name}", text)  # in one folder of the zip, as some workers send it
        archive.writestr("SmolLM2/model.safetensors", "not read")
    assert HFTokenizer.from_bundle(buffer.getvalue(), "worker").prompt("Hello world") == ours.prompt("Hello world")
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")  # beside the config, it wins
    folder = HFTokenizer.from_folder(tmp_path)
    assert folder.chat_template == "{{ messages[0]['content'] }}" and folder.end_ids == ours.end_ids


def test_what_cannot_be_read_is_a_bad_model_file_naming_it(smollm2):
    _, _, files = written(smollm2)
    with pytest.raises(BadModelFile, match="no tokenizer.json"):
        HFTokenizer({"config.json": "{}"}, "folder")
    with pytest.raises(BadModelFile, match="not JSON"):
        HFTokenizer({**files, "config.json": "{"}, "folder")
    spec = json.loads(files["tokenizer.json"])
    spec["model"] = {"type": "WordPiece", "vocab": {"a": 0}}
    with pytest.raises(BadModelFile, match="WordPiece tokenizer is not supported"):
        HFTokenizer({**files, "tokenizer.json": json.dumps(spec)}, "folder")
    with pytest.raises(BadModelFile, match="cannot be read"):
        HFTokenizer.from_bundle(b"not a zip", "worker h1:30000")
