"""The engine layer on the real tiny model: tokenizer traps, prefix reuse, sampling, stops."""

import dataclasses

import numpy as np
import pytest

from kronk_wsgi.engine.base import Cancelled
from kronk_wsgi.engine.chat_template import ChatTemplate, ChatTemplateError
from kronk_wsgi.engine.ctransformers_engine import CTransformersEngine
from kronk_wsgi.engine.demo_model import write_demo_model
from kronk_wsgi.engine.generate import DecodeOptions, Generation, StopScanner
from kronk_wsgi.engine.gguf_file import BadModelFile, read_gguf
from kronk_wsgi.engine.sampling import Sampler, SamplingParams
from kronk_wsgi.engine.tokenizer import GGUFTokenizer


@pytest.fixture(scope="module")
def engine(tiny_model):
    return CTransformersEngine("tiny", tiny_model)


def test_demo_model_is_deterministic(tmp_path, tiny_model):
    again = write_demo_model(tmp_path / "again.gguf", "tiny")
    assert again.read_bytes() == tiny_model.read_bytes()
    info = read_gguf(tiny_model)
    assert info.architecture == "llama" and info.context_length == 2048
    tokenizer = GGUFTokenizer(info)
    assert info.chat_template and tokenizer.token_text(tokenizer.bos_id) == "<s>"
    assert tokenizer.token_text(tokenizer.eos_id) == "</s>" and tokenizer.end_ids == {2}


def test_truncated_file_is_refused(tmp_path, tiny_model):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_model.read_bytes()[: tiny_model.stat().st_size // 2])
    with pytest.raises(BadModelFile):
        read_gguf(cut)


def test_tokenize_never_truncates(engine):
    # Byte-fallback tokens outnumber characters: ctransformers' own tokenize overflows here.
    text = "😀🎉 世界 ÿ"
    tokens = engine.tokenizer.prompt(text)
    assert len(tokens) > len(text) + 1
    assert engine.tokenizer.decode(tokens).decode("utf-8") == text
    assert engine.tokenizer.decode(engine.tokenizer.encode(" two  spaces ")) == " two  spaces ".encode()


def test_context_length_is_the_files(engine):
    assert engine.context_length == 2048


def test_prefix_is_reused_between_prompts(engine):
    slot = engine.new_slots(1, 1)[0]
    first = engine.tokenizer.prompt("The model server streams tokens to many clients")
    second = engine.tokenizer.prompt("The model server streams tokens to many clients and more")
    assert slot.prefill(first) == 0
    reused = slot.prefill(second)
    assert reused == len(first)
    logits_reused = slot.logits()
    other = engine.new_slots(1, 1)[0]
    other.prefill(second)
    logits_fresh = other.logits()
    np.testing.assert_array_equal(logits_reused, logits_fresh)


def test_prefill_is_cancellable_between_chunks(engine):
    slot = engine.new_slots(1, 1)[0]
    calls = []
    with pytest.raises(Cancelled):
        slot.prefill(engine.tokenizer.prompt("word " * 100), cancelled=lambda: calls.append(1) or len(calls) > 2, chunk=8)
    assert len(slot.cached) == 16  # two chunks in, then stopped


def generate(engine, slot, context_length=None, **options):
    prompt = engine.tokenizer.prompt("Hello")
    decode = DecodeOptions(**{"end_ids": engine.tokenizer.end_ids, "max_tokens": 20, "sampling": SamplingParams(seed=1),
                              **options})
    generation = Generation(slot, prompt, engine.tokenizer, decode, context_length or engine.context_length)
    return "".join(generation), generation


def test_seeded_generation_repeats_across_slots(engine):
    a, _ = generate(engine, engine.new_slots(1, 1)[0])
    b, _ = generate(engine, engine.new_slots(1, 1)[0])
    c, _ = generate(engine, engine.new_slots(1, 1)[0], sampling=SamplingParams(seed=2))
    assert a == b and a != c


def test_length_at_the_context_window(engine, tiny_model):
    small = CTransformersEngine("small", tiny_model, context_length=64)
    slot = small.new_slots(1, 1)[0]
    bias = ((2, -100.0),)
    text, generation = generate(small, slot, max_tokens=1000, context_length=64, sampling=SamplingParams(seed=1, logit_bias=bias))
    assert generation.finish_reason == "length"
    assert len(slot.cached) == 64  # filled, never past the window
    assert generation.completion_tokens == 64 - len(small.tokenizer.prompt("Hello")) + 1


def test_stop_scanner_holds_back_partial_matches():
    scanner = StopScanner(["END", "xyz"])
    assert scanner.feed("hello E") == ("hello ", False)
    assert scanner.feed("N") == ("", False)
    assert scanner.feed("X") == ("ENX", False)
    assert scanner.feed("abc xy") == ("abc ", False)
    assert scanner.feed("zzz") == ("", True)
    assert StopScanner([]).feed("all") == ("all", False)


def test_utf8_is_never_split(engine, monkeypatch):
    slot = engine.new_slots(1, 1)[0]
    piece = engine.tokenizer.piece
    emoji = engine.tokenizer.encode("😀")
    byte_tokens = [t for t in emoji if len(piece(t)) == 1 and piece(t)[0] >= 0x80]
    assert len(byte_tokens) == 4  # the emoji is four byte tokens
    forced = iter(byte_tokens)
    monkeypatch.setattr(Sampler, "sample", lambda self, logits, allowed: next(forced))
    decode = DecodeOptions(end_ids=engine.tokenizer.end_ids, max_tokens=4, sampling=SamplingParams(seed=0))
    generation = Generation(slot, engine.tokenizer.prompt("Hello"), engine.tokenizer, decode, 2048)
    assert list(generation) == ["😀"]  # one delta: no half characters on the way


@pytest.mark.parametrize("shown,text", [(frozenset(), ""), (frozenset({1}), "<s>")])
def test_control_tokens_add_no_text_unless_shown(engine, monkeypatch, shown, text):
    forced = iter([1, 2])  # <s> (a control token), then </s> (the end)
    monkeypatch.setattr(Sampler, "sample", lambda self, logits, allowed: next(forced))
    decode = DecodeOptions(end_ids=frozenset({2}), shown=shown, max_tokens=4, sampling=SamplingParams(seed=0))
    generation = Generation(engine.new_slots(1, 1)[0], engine.tokenizer.prompt("Hello"), engine.tokenizer, decode, 2048)
    assert "".join(generation) == text and generation.finish_reason == "stop"


def test_a_template_that_writes_bos_gets_no_second_one(engine):
    prompt = ChatTemplate.for_model("llama2", None, "<s>", "</s>", engine.tokenizer.control).render(
        [{"role": "user", "content": "hi"}])
    tokens = engine.tokenizer.prompt(prompt.text, inert=prompt.inert)
    assert tokens[0] == engine.tokenizer.bos_id and tokens.count(engine.tokenizer.bos_id) == 1
    assert engine.tokenizer.prompt("hi")[0] == engine.tokenizer.bos_id  # add_bos_token: a bare prompt gets one


def test_sampler_greedy_and_filters():
    logits = np.array([0.0, 5.0, 4.9, -3.0], dtype=np.float32)
    assert Sampler(SamplingParams(temperature=0), []).sample(logits) == 1
    top1 = Sampler(SamplingParams(top_k=1, seed=3), [])
    assert {top1.sample(logits) for _ in range(20)} == {1}
    min_p = Sampler(SamplingParams(min_p=0.5, seed=3), [])
    assert {min_p.sample(logits) for _ in range(50)} <= {1, 2}
    top_p = Sampler(SamplingParams(top_p=0.4, seed=3), [])
    assert {top_p.sample(logits) for _ in range(20)} == {1}
    biased = Sampler(SamplingParams(temperature=0, logit_bias=((3, 100.0),)), [])
    assert biased.sample(logits) == 3


@pytest.mark.parametrize("params", [SamplingParams(top_p=0.9), SamplingParams(top_p=0.999), SamplingParams(min_p=0.2),
                                    SamplingParams(min_p=1e-4), SamplingParams(top_k=40, top_p=0.5)])
def test_filters_on_a_large_vocabulary_keep_what_a_full_sort_keeps(params):
    """Through the Sampler (its parameters passed on to the draw): what a full sort keeps, in proportion."""
    rng = np.random.default_rng(3)
    peaked = (rng.standard_normal(49152) * 2).astype(np.float32)
    peaked[:50] += 8  # a few likely tokens
    flat = rng.standard_normal(49152).astype(np.float32) * 0.1  # top_p and min_p keep thousands
    for logits in (peaked, flat):
        order = np.argsort(-logits.astype(np.float64), kind="stable")[: params.top_k or None]
        probs = np.exp(logits[order].astype(np.float64) - logits[order[0]])
        probs /= probs.sum()
        keep = len(order)
        if params.top_p < 1:
            keep = min(keep, int(np.searchsorted(np.cumsum(probs), params.top_p)) + 1)
        if params.min_p > 0:
            keep = min(keep, int(np.count_nonzero(probs >= params.min_p * probs[0])))
        kept = set(order[:keep].tolist())
        sampler = Sampler(dataclasses.replace(params, seed=5), [])
        drawn = [sampler.sample(logits) for _ in range(600)]
        assert set(drawn) <= kept
        top_share = probs[0] / probs[:keep].sum()  # the best token's probability among those kept
        assert abs(drawn.count(order[0]) / len(drawn) - top_share) < 0.1


def test_sampler_penalties():
    logits = np.array([1.0, 1.0, 0.0], dtype=np.float32)
    presence = Sampler(SamplingParams(temperature=0, presence_penalty=2.0), [])
    assert [presence.sample(logits) for _ in range(2)] == [0, 1]
    repetition = Sampler(SamplingParams(temperature=0, repetition_penalty=5.0), [0])
    assert repetition.sample(logits) == 1


def test_samplers_do_not_share_randomness():
    logits = np.zeros(1000, dtype=np.float32)
    a = [Sampler(SamplingParams(), []).sample(logits) for _ in range(5)]
    assert len(set(a)) > 1  # unseeded requests draw fresh entropy each


def test_chat_template_sandbox_and_errors():
    template = ChatTemplate.for_model(None, None, "<s>", "</s>")
    text = template.render([{"role": "user", "content": "hi"}]).text
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    evil = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        evil.render([{"role": "user", "content": "x"}])
    strict = ChatTemplate("{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}")
    with pytest.raises(ChatTemplateError, match="first must be user"):
        strict.render([{"role": "assistant", "content": "x"}])
    llama2 = ChatTemplate.for_model("llama2", "ignored", "<s>", "</s>")
    assert llama2.render([{"role": "user", "content": "hi"}]).text == "<s>[INST] hi [/INST]"
