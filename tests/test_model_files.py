"""Model files before an engine sees them: the compatibility check, prepared copies, `kronk-wsgi inspect`."""

import subprocess
import sys

import gguf
import pytest

from kronk_wsgi.engine.ctransformers_engine import CTransformersEngine
from kronk_wsgi.engine.ctransformers_files import UnsupportedModel, check, compatible_file
from kronk_wsgi.engine.gguf_file import read_gguf
from kronk_wsgi.engine.tokenizer import GGUFTokenizer

from .conftest import ROOT
from .support.gguf_headers import write_header


@pytest.mark.parametrize("architecture", ["qwen2", "gemma3", "phi3"])
def test_other_architectures_are_refused_by_name(tmp_path, architecture):
    model = read_gguf(write_header(tmp_path / "m.gguf", architecture))
    result = check(model)
    assert not result.runs and f"architecture {architecture!r}" in result.problems[0]
    with pytest.raises(UnsupportedModel, match=f"architecture {architecture!r}"):
        compatible_file(model, tmp_path)


@pytest.mark.parametrize("kind", [gguf.GGMLQuantizationType.BF16, gguf.GGMLQuantizationType.IQ4_NL])
def test_unsupported_tensor_types_are_named(tmp_path, kind):
    result = check(read_gguf(write_header(tmp_path / "m.gguf", tensor_type=kind)))
    assert result.problems == (f"tensor type {kind.name}: this engine runs F32, F16, Q4_0-Q8_0 and Q2_K-Q6_K",)


def test_unknown_tensors_are_named(tmp_path):
    result = check(read_gguf(write_header(tmp_path / "m.gguf", extra_tensors=("rope_freqs.weight",))))
    assert not result.runs and "rope_freqs.weight (Llama 3.1 rope scaling)" in result.problems[0]


def test_special_token_ids_outside_the_vocabulary_are_refused(tmp_path):
    result = check(read_gguf(write_header(tmp_path / "m.gguf", eos=99)))
    assert result.problems == ("tokenizer.ggml.eos_token_id 99 lies outside the vocabulary of 9",)


def test_demo_model_runs_as_it_is(tiny_model, tmp_path):
    model = read_gguf(tiny_model)
    assert check(model).runs and not check(model).fixes
    assert compatible_file(model, tmp_path) == tiny_model


@pytest.mark.parametrize("tensor_type", [None, gguf.GGMLQuantizationType.Q8_0], ids=["F32", "Q8_0"])
def test_byte_level_tied_file_runs_from_a_prepared_copy(tmp_path, monkeypatch, tensor_type):
    """A Llama 3-style header (byte-level BPE, tied embeddings) loads and evaluates; the C engine alone would not."""
    source = write_header(tmp_path / "tied.gguf", tensor_type=tensor_type, tied=True)
    fixes = check(read_gguf(source)).fixes
    assert any("tied embeddings" in fix for fix in fixes) and any("byte-level" in fix for fix in fixes)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    engine = CTransformersEngine("tied", source)
    slot = engine.new_slots(1, 1)[0]
    slot.prefill(engine.tokenizer.prompt("ab a\nb"))
    assert slot.logits().shape == (engine.tokenizer.vocab_size,)
    (copy,) = (tmp_path / "cache" / "kronk_wsgi" / "prepared").glob("*.gguf")
    prepared = read_gguf(copy)
    assert prepared.get("tokenizer.ggml.tokens")[2] == "\n"  # "Ċ" spelled as the byte it stands for
    assert prepared.get("tokenizer.ggml.tokens")[7] == "<|im_start|>"  # control tokens as they are
    assert prepared.tensor("output.weight").n_bytes == prepared.tensor("token_embd.weight").n_bytes


def test_pre_tokenizer_the_file_names_is_used(tmp_path):
    tokenizer = GGUFTokenizer(read_gguf(write_header(tmp_path / "m.gguf")))
    assert tokenizer.pre == "default" and tokenizer.encode("ab a\n") == [6, 5, 2]
    assert tokenizer.prompt("<|im_start|>ab<|im_end|>") == [7, 6, 8]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kronk_wsgi.cli", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


def test_inspect_tells_what_a_user_needs(smollm2):
    result = run_cli("inspect", str(smollm2), "--context-length", "4096")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for expected in ("architecture    llama", "134.5 M", "Q4_1", "8192 trained; 4096 served", "gpt2, pre-tokenizer smollm",
                     "49152 tokens", "EOS <|im_end|> (2)", "prompts start with BOS: no", "<|im_start|>system",
                     "94 MB of KV cache per slot at context 4096", "ctransformers, from a prepared copy"):
        assert expected in out, expected


def test_inspect_says_why_a_file_cannot_run(tmp_path):
    result = run_cli("inspect", str(write_header(tmp_path / "q.gguf", "qwen2")))
    assert result.returncode == 0 and "ctransformers cannot" in result.stdout and "architecture 'qwen2'" in result.stdout
    assert run_cli("inspect", str(ROOT / "setup.py")).returncode == 2
