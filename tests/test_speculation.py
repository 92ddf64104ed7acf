"""Speculative decoding (n-gram drafts or a draft model's, checked several tokens in one llama.cpp call): the same
replies as without it.

In-process tests run the real engine on SmolLM2; the server tests run real gunicorn with the model's setting on. The
draft models are SmolLM2 itself (whose drafts are nearly all taken) and a model of SmolLM2's vocabulary with random
weights (whose drafts are refused).
Replies are compared within 512 tokens of context, where llama.cpp computes a token's logits the same in a batch
of drafts as alone (past it, a single token's attention is split across threads: docs/ENGINES.rst).
"""

import contextlib
import json
import os
from concurrent.futures import ThreadPoolExecutor

import llama_cpp
import pytest
import requests

from kronk_wsgi.config import Speculative
from kronk_wsgi.engine import llamacpp_engine
from kronk_wsgi.engine.base import DraftSlot
from kronk_wsgi.engine.demo_model import write_demo_model
from kronk_wsgi.engine.gguf_file import read_gguf
from kronk_wsgi.engine.generate import DecodeOptions, Generation
from kronk_wsgi.engine.grammar import Grammar, json_schema_grammar
from kronk_wsgi.engine.sampling import SamplingParams
from kronk_wsgi.engine.speculation import DraftCosts, NgramDrafter, Speculation, shared_vocabulary
from kronk_wsgi.engine.tokenizer import GGUFTokenizer
from kronk_wsgi.testing import metric, run_server
from kronk_wsgi.testing.random_models import write_draft_model

if not llamacpp_engine.available():
    if os.environ.get("KRONK_TEST_REQUIRE_LLAMACPP") == "1":
        raise RuntimeError("llama-cpp-python is required (KRONK_TEST_REQUIRE_LLAMACPP=1) but not installed")
    pytest.skip("llama-cpp-python is not installed (pip install 'kronk_wsgi[llamacpp]')", allow_module_level=True)

CODE = "".join(f"def area_{i}(width, height):\n    return width * height + {i}\n\n" for i in range(8))
PROMPTS = {
    # The reply begun at a name's opening bracket: a prompt cut inside a word ("de") was read as another word on
    # some CPUs' numerics, and the reply did not copy at all.
    "code": f"<|im_start|>user\nRepeat this code exactly:\n{CODE}<|im_end|>\n<|im_start|>assistant\n"
            + CODE[:CODE.index("def area_1")] + "def area_1(",
    "chat": "<|im_start|>user\nWhat is the capital of France? Tell me about it.<|im_end|>\n<|im_start|>assistant\n",
    "list": "Count: one two three four five, one two three four five, one two three four five, one two",
}


def costs(single: float, **calls: float) -> DraftCosts:
    """Costs measured on a slot: a call of one row, and calls of ``rows_N`` rows."""
    measured = DraftCosts()
    measured.record(1, single)
    for rows, seconds in calls.items():
        measured.record(int(rows.removeprefix("rows_")), seconds)
    return measured


FREE_ROWS = costs(0.01, rows_2=0.01)  # rows beyond the first cost nothing: any draft pays


def test_drafts_follow_the_earlier_occurrence_that_matches_longest():
    line = [50, 51, 52, 53, 54, 55, 56]  # a line of a file; its last three tokens recur in another line
    other = [90, 91, 92, 93, 94, 55, 56]
    drafter = NgramDrafter([40, 41, *line, 60, 61, 62, *other, 70, 71, 72, 40, 41, *line[:6]], FREE_ROWS)
    assert drafter.draft(3) == [56, 60, 61]  # the line goes on as it did
    drafter.add(56)
    # (54, 55, 56) follows the first line and, later, the other one: the first matches the text's end longer
    assert drafter.draft(3) == [60, 61, 62]


def test_a_short_match_is_no_draft():
    drafter = NgramDrafter([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], FREE_ROWS)
    for token in (30, 31, 32, 33, 5, 6, 7):  # shares (5, 6, 7) with the start, and only that
        drafter.add(token)
    assert drafter.draft(8) == []
    drafter = NgramDrafter([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], FREE_ROWS)
    for token in range(1, 9):  # the text's end matches its start for eight tokens
        drafter.add(token)
    assert drafter.draft(8) == [9, 10, 11, 12, 1, 2, 3, 4]


# Calls of 1 to 32 rows as measured at 2,700 tokens of context (2 cores): Gemma 3's rows cost 0.4-0.7 of a token
# each, SmolLM2's 0.65-1.3
GEMMA_COSTS = dict(single=0.016, rows_2=0.0272, rows_4=0.0384, rows_8=0.0576, rows_16=0.1056, rows_32=0.192)
SMOLLM2_COSTS = dict(single=0.017, rows_2=0.0391, rows_4=0.0578, rows_8=0.1054, rows_16=0.1989, rows_32=0.3689)


def test_a_draft_is_as_long_as_pays_by_what_rows_cost_and_how_drafts_went():
    gemma, smollm2 = costs(**GEMMA_COSTS), costs(**SMOLLM2_COSTS)
    assert gemma.relative(8) == pytest.approx(3.6) and gemma.relative(12) > gemma.relative(8)
    assert gemma.relative(64) == pytest.approx(1 + 63 * (0.192 - 0.016) / 31 / 0.016)  # as the largest measured
    assert costs(0.016, rows_8=0.0576).relative(2) == pytest.approx(1 + (0.0576 - 0.016) / 7 / 0.016)
    copying, straying = NgramDrafter([], gemma), NgramDrafter([], gemma)
    for _ in range(20):
        copying.checked(16, 16)
        straying.checked(4, 1)
    assert copying.paying_length(64) >= 16 and straying.paying_length(64) == 0
    assert 0 < NgramDrafter([], gemma).paying_length(64) < 16  # a first draft, at a rate of 3 in 4 taken
    smollm2_copying = NgramDrafter([], smollm2)
    for _ in range(20):
        smollm2_copying.checked(16, 16)
    assert smollm2_copying.paying_length(64) > 16  # only long drafts taken whole pay on SmolLM2
    assert NgramDrafter([], smollm2).paying_length(64) == 0


@pytest.fixture(scope="module")
def engine(smollm2):
    engine = llamacpp_engine.LlamaCppEngine("smollm2", smollm2, 2048)
    engine.slots = engine.new_slots(2, 2)
    yield engine
    engine.close()


def reply(engine, prompt: str, speculation=None, slot=0, **options):
    """A reply from an empty slot: its text and the Generation (its drafting)."""
    chosen = engine.slots[slot]
    chosen.truncate(0)
    tokens = engine.tokenizer.prompt(prompt)
    decode = DecodeOptions(end_ids=engine.tokenizer.end_ids, max_tokens=options.pop("max_tokens", 160),
                           speculation=speculation, **options)
    generation = Generation(chosen, tokens, engine.tokenizer, decode, 512)
    return "".join(generation), generation


SPECULATION = Speculation(n_min=2)  # drafts wherever a match offers them: these tests check what drafts change
GREEDY = SamplingParams(temperature=0)


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_greedy_replies_are_the_same_token_for_token(engine, name):
    plain, _ = reply(engine, PROMPTS[name], sampling=GREEDY)
    drafted, generation = reply(engine, PROMPTS[name], SPECULATION, sampling=GREEDY)
    assert drafted == plain
    if name in ("code", "list"):  # a reply that repeats its prompt takes drafts
        assert generation.drafting.accepted > generation.drafting.drafts > 0


def test_sampled_replies_are_the_same_for_the_same_seed(engine):
    """Each token is picked on the same logits with the same random draw, drafted or not."""
    for seed in range(4):
        sampling = SamplingParams(temperature=0.9, top_p=0.95, seed=seed)
        plain, _ = reply(engine, PROMPTS["list"], sampling=sampling, max_tokens=80)
        drafted, generation = reply(engine, PROMPTS["list"], SPECULATION, sampling=sampling, max_tokens=80)
        assert drafted == plain
        assert generation.drafting.drafts > 0


def test_drafts_never_taken_change_nothing_and_are_cut_from_the_cache(engine, monkeypatch):
    """Every draft is a token the logit bias bans: each is refused at its first token, the reply is the same, and
    the refused tokens are cut from the sequence at the next call: it holds exactly the tokens the slot lists,
    which a next turn reuses."""
    banned = engine.tokenizer.encode(" five")[0]
    sampling = SamplingParams(temperature=0, logit_bias=((banned, float("-inf")),))
    plain, _ = reply(engine, PROMPTS["chat"], sampling=sampling, max_tokens=40)
    monkeypatch.setattr(NgramDrafter, "draft", lambda self, limit, least: [banned] * min(limit, 3))
    drafted, generation = reply(engine, PROMPTS["chat"], SPECULATION, sampling=sampling, max_tokens=40)
    assert drafted == plain
    assert generation.drafting.drafts >= 30 and generation.drafting.accepted == 0
    slot = engine.slots[0]
    held = len(slot.cached)  # the prompt and the reply (its last token is not evaluated)
    follow = engine.tokenizer.prompt(PROMPTS["chat"] + drafted + " Also,")
    options = DecodeOptions(end_ids=engine.tokenizer.end_ids, max_tokens=20, sampling=GREEDY)
    continued = Generation(slot, follow, engine.tokenizer, options, 512)
    "".join(continued)
    assert continued.cached_tokens >= held - 2  # a token or two at the seam may tokenize otherwise
    memory = llama_cpp.llama_get_memory(engine._ctx)
    assert llama_cpp.llama_memory_seq_pos_max(memory, 0) == len(slot.cached) - 1


def test_grammar_and_stop_sequences_hold_with_drafts(engine):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "count": {"type": "integer"}},
              "required": ["name", "count"]}
    grammar = Grammar(engine.tokenizer, engine.tokenizer.end_ids, json_schema_grammar(schema))
    prompt = ("<|im_start|>user\nGive JSON like {\"name\": \"one\", \"count\": 1} or {\"name\": \"two\", \"count\": 2}"
              "<|im_end|>\n<|im_start|>assistant\n")
    plain, _ = reply(engine, prompt, sampling=GREEDY, grammar=grammar)
    drafted, _ = reply(engine, prompt, SPECULATION, sampling=GREEDY, grammar=grammar)
    assert drafted == plain
    assert json.loads(drafted).keys() == {"name", "count"}
    plain, _ = reply(engine, PROMPTS["list"], sampling=GREEDY, stop=("four",))
    drafted, generation = reply(engine, PROMPTS["list"], SPECULATION, sampling=GREEDY, stop=("four",))
    assert drafted == plain and generation.stop_sequence == "four"


def test_penalties_and_a_thinking_budget_hold_with_drafts(engine):
    """Penalties count each token picked, drafted or not; a spent thinking budget forces its closing tag's tokens
    over any draft."""
    penalised = SamplingParams(temperature=0, repetition_penalty=1.2, presence_penalty=0.4, frequency_penalty=0.2)
    budget = dict(thinking_close=" banana", thinking_budget=3)
    for options in (dict(sampling=penalised), dict(sampling=GREEDY, **budget)):
        plain, _ = reply(engine, PROMPTS["list"], max_tokens=60, **options)
        drafted, generation = reply(engine, PROMPTS["list"], SPECULATION, max_tokens=60, **options)
        assert drafted == plain and generation.drafting.drafts > 0
    assert " banana" in plain[:30]  # forced after three tokens


@pytest.fixture(scope="module")
def random_draft(smollm2, tmp_path_factory):
    return write_draft_model(tmp_path_factory.mktemp("draft") / "random-draft.gguf", smollm2)


@contextlib.contextmanager
def drafting_with(engine, path):
    """The engine's slots draft with the model at ``path``, a slot of its own each."""
    draft = llamacpp_engine.LlamaCppEngine("draft", path, 2048)
    vocabulary = shared_vocabulary(engine.tokenizer, draft.tokenizer)
    for slot, draft_slot in zip(engine.slots, draft.new_slots(len(engine.slots), 2)):
        slot.draft = DraftSlot(draft_slot, vocabulary)
    try:
        yield draft
    finally:
        for slot in engine.slots:
            slot.draft = None
        draft.close()


@pytest.mark.parametrize("name", ["code", "chat"])
def test_a_draft_model_gives_the_same_replies(engine, smollm2, random_draft, name):
    """SmolLM2 drafting for itself proposes what it picks: its drafts are taken nearly whole. The random model's
    are refused at their first token (n_min makes it draft anyway); either way the reply is the model's own."""
    plain, _ = reply(engine, PROMPTS[name], sampling=GREEDY, max_tokens=40)
    with drafting_with(engine, smollm2):
        drafted, generation = reply(engine, PROMPTS[name], SPECULATION, sampling=GREEDY, max_tokens=40)
    assert drafted == plain
    assert generation.drafting.accepted >= 0.9 * generation.drafting.drafted > 0
    with drafting_with(engine, random_draft):
        drafted, generation = reply(engine, PROMPTS[name], SPECULATION, sampling=GREEDY, max_tokens=40)
    assert drafted == plain
    assert generation.drafting.drafts > 10 and generation.drafting.accepted <= generation.drafting.drafts // 10


def test_a_draft_model_drafts_only_what_pays_and_what_it_is_sure_of(engine, smollm2, random_draft):
    """Without n_min, the random model (a token's probability about 1 in 49,152) drafts nothing; with p_min, the
    confident draft model drafts only where it is that sure (SmolLM2 drafting for itself costs what it saves: past
    n_min's one token it drafts no more)."""
    with drafting_with(engine, random_draft):
        _, generation = reply(engine, PROMPTS["list"], Speculation(), sampling=GREEDY, max_tokens=40)
    assert generation.drafting.drafts == 0
    with drafting_with(engine, smollm2):
        _, loose = reply(engine, PROMPTS["chat"], Speculation(n_min=1), sampling=GREEDY, max_tokens=50)
        _, strict = reply(engine, PROMPTS["chat"], Speculation(n_min=1, p_min=0.99), sampling=GREEDY, max_tokens=50)
    assert 0 < strict.drafting.drafts < loose.drafting.drafts


def test_a_draft_models_slot_follows_one_cache_scope(engine, smollm2, monkeypatch):
    """The draft model's slot reuses what it holds of the same tenant's prompt, never another tenant's: that would
    show in how fast a reply comes."""
    slot = engine.slots[1]
    prompt = len(engine.tokenizer.prompt(PROMPTS["code"]))
    with drafting_with(engine, smollm2):
        evaluated = []
        decode = slot.draft.slot.decode
        monkeypatch.setattr(slot.draft.slot, "decode", lambda tokens, pick=None: evaluated.append(len(tokens))
                            or decode(tokens, pick))

        def evaluated_for(scope: str) -> int:
            evaluated.clear()
            slot.scope = scope
            reply(engine, PROMPTS["code"], SPECULATION, slot=1, sampling=GREEDY, max_tokens=20)
            return sum(evaluated)

        assert evaluated_for("tenant-a") >= prompt
        assert evaluated_for("tenant-a") < prompt // 2  # the same prompt again: its prefix reused
        assert evaluated_for("tenant-b") >= prompt
    slot.scope = ""


def test_a_draft_model_must_share_the_vocabulary(smollm2, gemma3, random_draft):
    assert shared_vocabulary(GGUFTokenizer(read_gguf(smollm2)), GGUFTokenizer(read_gguf(random_draft))) == 49152
    with pytest.raises(ValueError, match="vocabulary"):
        shared_vocabulary(GGUFTokenizer(read_gguf(smollm2)), GGUFTokenizer(read_gguf(gemma3)))
    with pytest.raises(ValueError, match="draft_model"):
        Speculative(type="draft")
    with pytest.raises(ValueError, match="draft_model"):
        Speculative(draft_model=str(smollm2))


@pytest.fixture(scope="module")
def server(smollm2, gemma3, tmp_path_factory):
    """SmolLM2, and a demo model of float32 weights (whose every kernel computes a row the same in any batch, so
    that replies decoded beside others can be compared), both with speculation on, two slots each; SmolLM2 drafting
    with itself as its draft model, and with Gemma 3, whose vocabulary differs."""
    folder = tmp_path_factory.mktemp("speculative")
    demo = write_demo_model(folder / "demo.gguf", "tiny", architecture="qwen2")
    models = {name: {"path": str(path), "engine": "llama.cpp", "context_length": 512,
                     "speculative": {"n_max": 16, "n_min": 2}}
              for name, path in (("smollm2", smollm2), ("demo", demo))}
    for name, draft in (("drafted", smollm2), ("mismatched", gemma3)):
        models[name] = {"path": str(smollm2), "engine": "llama.cpp", "context_length": 512,
                        "speculative": {"type": "draft", "draft_model": str(draft), "n_min": 1}}
    env = {"KRONK_MODELS": json.dumps(models), "KRONK_DEFAULT_MODEL": "smollm2", "KRONK_PARALLEL": 2}
    with run_server(folder, env) as server:
        yield server


def complete(server, prompt: str, **fields) -> dict:
    body = {"prompt": prompt, "n_predict": 100, "temperature": 0, **fields}
    answer = requests.post(server.url + "/completion", json=body, timeout=300)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_replies_through_the_server_are_the_same_and_counted(server):
    """Each prompt is sent once first, so that the replies compared find it in the cache alike (a prompt evaluated
    whole and one whose last token is evaluated alone differ in the last digits)."""
    for prompt in PROMPTS.values():
        complete(server, prompt, n_predict=1)
    plain = {name: complete(server, prompt, **{"speculative.n_max": 0}) for name, prompt in PROMPTS.items()}
    before = metric(server, "llamacpp:spec_decode_num_accepted_tokens_total", model="smollm2")
    drafted = {name: complete(server, prompt) for name, prompt in PROMPTS.items()}
    assert {name: a["content"] for name, a in drafted.items()} == {name: a["content"] for name, a in plain.items()}
    assert "draft_n" not in plain["code"]["timings"]
    code = drafted["code"]["timings"]
    assert code["draft_n"] > 0 and 0 < code["draft_n_accepted"] <= code["draft_n"]
    assert metric(server, "llamacpp:spec_decode_num_accepted_tokens_total", model="smollm2") > before
    assert metric(server, "llamacpp:spec_decode_num_drafts_total", model="smollm2") > 0
    assert metric(server, "kronk_spec_decode_accepted_tokens_total", model="smollm2", position="1") > 0
    logged = [line for line in server.completed() if line.get("drafted_tokens")]
    assert logged and all(0 <= line["accepted_tokens"] <= line["drafted_tokens"] for line in logged)


DEMO_PROMPTS = ["hello model server token stream hello model server token stream hello model server token stream",
                "water long little very after words water long little very after words water long little very",
                "the of and to in is that it was for on are as with the of and to in is that it was for on are as"]


def test_two_slots_speculating_at_once_reply_as_without(server):
    for prompt in DEMO_PROMPTS:
        complete(server, prompt, model="demo", n_predict=1)
    plain = [complete(server, prompt, model="demo", **{"speculative.n_max": 0})["content"] for prompt in DEMO_PROMPTS]
    with ThreadPoolExecutor(len(DEMO_PROMPTS)) as pool:
        answers = list(pool.map(lambda prompt: complete(server, prompt, model="demo"), DEMO_PROMPTS))
    assert [answer["content"] for answer in answers] == plain
    assert sum(answer["timings"].get("draft_n_accepted", 0) for answer in answers) > 0


def test_a_request_sets_the_draft_length_or_turns_it_off(server):
    complete(server, PROMPTS["list"], n_predict=1)
    off = complete(server, PROMPTS["list"], **{"speculative.n_max": 0})
    short = complete(server, PROMPTS["list"], **{"speculative.n_max": 2, "speculative.n_min": 2})
    assert short["content"] == off["content"]
    assert 0 < short["timings"]["draft_n_accepted"] <= short["timings"]["draft_n"]
    assert complete(server, PROMPTS["list"], **{"speculative.p_min": 0.5})["content"] == off["content"]


def test_a_model_drafts_with_its_draft_model(server):
    for prompt in PROMPTS.values():
        complete(server, prompt, model="drafted", n_predict=1)
    plain = {name: complete(server, prompt, model="drafted", n_predict=40, **{"speculative.n_max": 0})["content"]
             for name, prompt in PROMPTS.items()}
    drafted = {name: complete(server, prompt, model="drafted", n_predict=40) for name, prompt in PROMPTS.items()}
    assert {name: answer["content"] for name, answer in drafted.items()} == plain
    timings = drafted["code"]["timings"]
    assert timings["draft_n_accepted"] >= 0.9 * timings["draft_n"] > 0
    slots = requests.get(server.url + "/slots", params={"model": "drafted"}, timeout=30).json()
    assert slots and all(slot["speculative"] for slot in slots)
    refused = requests.post(server.url + "/completion", json={"prompt": "x", "model": "mismatched"}, timeout=60)
    assert refused.status_code == 503
    message = refused.json()["error"]["message"]
    assert "draft model" in message and "vocabulary" in message and "/" not in message
