"""The prompt cache: saved slot states found by their longest prefix, in RAM and on disk within budgets, never
restored when foreign, corrupt or truncated; on the real llama.cpp engine, restoring equals recomputing."""

import hashlib
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from anthropic import Anthropic
from openai import OpenAI

from kronk_wsgi.describe import kv_cache_bytes
from kronk_wsgi.engine import llamacpp_engine
from kronk_wsgi.engine.gguf_file import read_gguf
from kronk_wsgi.engine.prompt_cache import BLOCK, SUFFIX, PromptCache

from .conftest import metric, run_server

MB = 1_000_000


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 49_000, n).tolist()


def state(n: int, fill: int = 1) -> bytes:
    return bytes([fill]) * n


def test_the_longest_block_aligned_prefix_is_found():
    cache = PromptCache("model a", 10 * MB, None, 0)
    system = tokens(0, 3 * BLOCK)
    first = system + tokens(1, 2 * BLOCK + 10)
    cache.put(first, state(100, 1))
    cache.put(system + tokens(2, BLOCK), state(100, 2))
    prompt = first[:4 * BLOCK + 5] + tokens(3, 50)  # continues the first for 4 blocks and 5 tokens
    shared, held, saved = cache.find(prompt)
    assert shared == 4 * BLOCK + 5 and held == tuple(first) and saved == state(100, 1)
    assert cache.find(tokens(9, 5 * BLOCK)) is None
    assert cache.find(first[:BLOCK - 1]) is None  # less than a block: nothing to restore
    counts = cache.take_counts()
    assert (counts.hits, counts.misses, counts.saved, counts.restored_tokens) == (1, 2, 2, 4 * BLOCK + 5)
    assert cache.holds(first) and not cache.holds(first[:-1])


def test_ram_holds_its_budget_least_recently_used_first_out():
    cache = PromptCache("model a", 3 * MB, None, 0)
    conversations = [tokens(i, 2 * BLOCK) for i in range(5)]
    for i, conversation in enumerate(conversations[:3]):
        cache.put(conversation, state(MB, i))
    cache.find(conversations[0])  # used: it stays
    cache.put(conversations[3], state(MB, 3))
    assert cache.held()[0] <= 3 * MB
    assert cache.find(conversations[0]) is not None and cache.find(conversations[1]) is None
    cache.put(conversations[4], state(4 * MB))  # larger than the whole budget: not kept
    assert cache.find(conversations[4]) is None and cache.take_counts().evicted_ram == 1


def test_workers_share_the_disk_tier_and_a_restart_keeps_it(tmp_path):
    conversation = tokens(5, 3 * BLOCK)
    one = PromptCache("model a", 10 * MB, tmp_path, 100 * MB)
    one.put(conversation, state(5000, 7))
    other = PromptCache("model a", 10 * MB, tmp_path, 100 * MB)  # another worker, or after a restart
    shared, _, saved = other.find(conversation + tokens(6, 20))
    assert shared == len(conversation) and saved == state(5000, 7)
    foreign = PromptCache("model b", 10 * MB, tmp_path, 100 * MB)  # another file or llama.cpp: never its states
    assert foreign.find(conversation) is None


def test_corrupt_truncated_and_foreign_disk_entries_are_ignored_and_counted(tmp_path):
    writer = PromptCache("model a", 0, tmp_path, 100 * MB)
    conversations = [tokens(10 + i, 2 * BLOCK) for i in range(4)]
    for conversation in conversations[:3]:
        writer.put(conversation, state(20_000, 3))
    flipped, cut, kept = sorted(Path(writer.disk_dir).glob("*" + SUFFIX))
    data = bytearray(flipped.read_bytes())
    data[-100] ^= 1  # one bit of the state
    flipped.write_bytes(bytes(data))
    cut.write_bytes(cut.read_bytes()[:5000])  # a write cut short
    foreign = PromptCache("model b", 0, tmp_path / "b", 100 * MB)  # another file's entry, under this one's name
    foreign.put(conversations[3], state(20_000, 4))
    (written,) = Path(foreign.disk_dir).glob("*" + SUFFIX)
    os.replace(written, Path(writer.disk_dir) / written.name)
    reader = PromptCache("model a", 0, tmp_path, 100 * MB)
    found = [reader.find(c) for c in conversations]
    assert sum(f is not None for f in found) == 1
    assert reader.take_counts().corrupt == 3
    assert [p.name for p in Path(writer.disk_dir).glob("*" + SUFFIX)] == [kept.name]


def test_the_disk_budget_holds_under_a_stream_of_conversations(tmp_path):
    cache = PromptCache("model a", 0, tmp_path, 5 * 20_000)
    for i in range(20):
        cache.put(tokens(100 + i, 2 * BLOCK), state(19_000, i))
    assert sum(f.stat().st_size for f in Path(cache.disk_dir).iterdir()) <= 5 * 20_000
    assert cache.take_counts().evicted_disk >= 15


def test_a_scope_never_finds_another_scopes_prefixes(tmp_path):
    cache = PromptCache("model a", 10 * MB, tmp_path, 100 * MB)
    memo = tokens(20, 4 * BLOCK)
    cache.put(memo, state(1000, 1), scope="key a")
    assert cache.find(memo + tokens(21, 5), "key b") is None
    assert cache.find(memo + tokens(21, 5)) is None  # no scope is a scope of its own too
    assert not cache.holds(memo, "key b") and cache.holds(memo, "key a")
    other_worker = PromptCache("model a", 10 * MB, tmp_path, 100 * MB)  # the scope is kept on disk with the entry
    assert other_worker.find(memo, "key b") is None and other_worker.find(memo, "key a")[0] == len(memo)
    assert cache.key_branch("k", memo, "key a") == 0 and cache.key_branch("k", memo[:3 * BLOCK] + tokens(22, BLOCK),
                                                                        "key b") == 0


def test_a_prompt_waits_for_an_entry_another_worker_announced(tmp_path):
    conversation = tokens(30, 3 * BLOCK + 7)
    writer = PromptCache("model a", 10 * MB, tmp_path, 100 * MB)
    reader = PromptCache("model a", 10 * MB, tmp_path, 100 * MB)
    writer.announce(conversation, "k")
    later = threading.Timer(0.3, writer.put, (conversation, state(5000, 9)), {"scope": "k"})
    later.start()
    shared, _, saved = reader.find(conversation + tokens(31, 20), "k")
    assert shared == len(conversation) and saved == state(5000, 9)
    assert not list(Path(writer.disk_dir).glob("*.pending"))
    writer.announce(tokens(32, 2 * BLOCK), "k")  # its writer died: once stale, nobody waits for it
    (pending,) = Path(writer.disk_dir).glob("*.pending")
    os.utime(pending, (time.time() - 60, time.time() - 60))
    assert reader.find(tokens(32, 2 * BLOCK), "k") is None and not pending.exists()
    writer.announce(tokens(33, 2 * BLOCK))
    writer.withdraw(tokens(33, 2 * BLOCK))  # its state could not be saved
    assert not list(Path(writer.disk_dir).glob("*.pending"))


def test_what_the_event_loop_asks_never_waits_for_a_disk_read(tmp_path):
    conversation = tokens(34, 3 * BLOCK)
    PromptCache("model a", 10 * MB, tmp_path, 100 * MB).put(conversation, state(50_000, 3))
    reader = PromptCache("model a", 10 * MB, tmp_path, 100 * MB)  # another worker: the state is on disk only
    reading, go_on = threading.Event(), threading.Event()
    read = reader.disk.read

    def slow_read(key, entry):  # a multi-gigabyte state being read and authenticated
        reading.set()
        assert go_on.wait(60)
        return read(key, entry)

    reader.disk.read = slow_read
    found = []
    slot_thread = threading.Thread(target=lambda: found.append(reader.find(conversation + tokens(35, 9))))
    slot_thread.start()
    assert reading.wait(60)
    asked = []  # what the loop asks, from a thread of its own so that a wait shows as a missing answer

    def loop_side():
        asked.append((reader.take_counts().misses, reader.held()))
        asked.append(reader.holds(tokens(36, 2 * BLOCK)))
        asked.append(reader.key_branch("k", conversation))

    loop = threading.Thread(target=loop_side)
    loop.start()
    loop.join(30)
    answered = len(asked)
    go_on.set()
    slot_thread.join(60)
    assert answered == 3, "a call waited for the disk read"
    assert found[0][0] == len(conversation) and reader.take_counts().hits == 1


def test_files_nobody_should_trust_are_skipped_counted_and_told_once(tmp_path):
    writer = PromptCache("model a", 0, tmp_path, 100 * MB)
    victim = tokens(40, 3 * BLOCK)
    writer.put(victim, state(20_000, 3))
    (genuine,) = Path(writer.disk_dir).glob("*" + SUFFIX)
    data = genuine.read_bytes()
    forged = data[:-32 - 20_000] + state(20_000, 6)  # another answer's state, its checksum recomputed
    genuine.write_bytes(forged + hashlib.sha256(forged).digest())
    directory = Path(writer.disk_dir)
    (directory / "zz-not-hex.kv").write_bytes(b"x")
    os.mkfifo(directory / ("ab" * 16 + SUFFIX))
    (directory / ("cd" * 16 + SUFFIX)).mkdir()
    huge = bytearray(data[:len(data) - 32 - 20_000 - 4 * len(victim)])
    huge[-16:-8] = (2 ** 61).to_bytes(8, "little")  # a header claiming 2^61 tokens
    (directory / ("ef" * 16 + SUFFIX)).write_bytes(bytes(huge) + b"\0" * 64)
    reader = PromptCache("model a", 0, tmp_path, 100 * MB)
    for _ in range(2):
        assert reader.find(victim) is None
    counts = reader.take_counts()
    assert counts.corrupt == 5 and len(counts.problems) == 5
    assert reader.take_counts().problems == []  # told once
    reader.put(victim, state(20_000, 3))  # the cleanup steps over what it cannot remove
    assert reader.find(victim) == (len(victim), tuple(victim), state(20_000, 3))
    assert sorted(p.name for p in directory.iterdir() if not p.name.startswith(".")) == sorted(
        [genuine.name, "ab" * 16 + SUFFIX, "cd" * 16 + SUFFIX])


def test_the_key_file_is_the_owners_alone(tmp_path):
    PromptCache("model a", 0, tmp_path, 100 * MB)
    key = tmp_path / ".key"
    assert key.stat().st_mode & 0o777 == 0o600
    key.chmod(0o644)
    cache = PromptCache("model a", 10 * MB, tmp_path, 100 * MB)  # a key others can read: no disk tier at all
    assert cache.disk_dir is None and "the disk tier is off" in cache.take_counts().problems[0]


def test_one_disk_budget_holds_for_the_whole_directory(tmp_path):
    old = PromptCache("model a, before its file changed", 0, tmp_path, 10 * 20_000)
    for i in range(8):
        old.put(tokens(200 + i, 2 * BLOCK), state(19_000, i))
    new = PromptCache("model a", 0, tmp_path, 10 * 20_000)
    other = PromptCache("model b", 0, tmp_path, 10 * 20_000)
    for i in range(8):
        new.put(tokens(300 + i, 2 * BLOCK), state(19_000, i))
        other.put(tokens(400 + i, 2 * BLOCK), state(19_000, i))
    held = sum(f.stat().st_size for f in tmp_path.glob("*/*" + SUFFIX))
    assert held <= 10 * 20_000
    assert not list(Path(old.disk_dir).glob("*" + SUFFIX))  # the oldest, an identity nobody uses, went first


needs_llamacpp = pytest.mark.skipif(not llamacpp_engine.available() and not os.environ.get("KRONK_TEST_REQUIRE_LLAMACPP"),
                                    reason="llama-cpp-python is not installed")


def greedy(slot, prompt: list[int], n: int) -> tuple[list[int], np.ndarray, int]:
    """Prefill, then n greedy tokens: the tokens, the first logits, and how many prompt tokens were reused."""
    reused = slot.prefill(prompt)
    first = slot.logits().copy()
    out = [int(np.argmax(first))]
    for _ in range(n - 1):
        slot.decode([out[-1]])
        out.append(int(np.argmax(slot.logits())))
    return out, first, reused


@needs_llamacpp
def test_restoring_equals_recomputing(smollm2, tmp_path):
    cached = llamacpp_engine.LlamaCppEngine("smol", smollm2, context_length=1024)
    (slot,) = cached.new_slots(1, 2)
    slot.state_cache = PromptCache(cached.state_identity(), 100 * MB, tmp_path, 100 * MB)
    plain = llamacpp_engine.LlamaCppEngine("smol", smollm2, context_length=1024)
    (fresh,) = plain.new_slots(1, 2)
    staying = llamacpp_engine.LlamaCppEngine("smol", smollm2, context_length=1024)
    (kept,) = staying.new_slots(1, 2)
    tokenizer = cached.tokenizer
    document = tokenizer.prompt("The history of the lighthouse. " * 40)
    other = tokenizer.prompt("A recipe for bread with flour, water and salt. " * 30)
    greedy(slot, document, 4)
    greedy(slot, other, 4)  # the slot goes to another conversation: the first is saved
    turn = document + tokenizer.encode(" What did the keepers do?")
    restored, restored_logits, reused = greedy(slot, turn, 12)
    assert reused >= len(document) - BLOCK  # the history came back from the cache
    greedy(kept, document, 4)
    in_slot, in_slot_logits, _ = greedy(kept, turn, 12)  # the same turn, its history never having left the slot
    assert restored == in_slot and np.allclose(restored_logits, in_slot_logits, atol=1e-4)
    recomputed, recomputed_logits, _ = greedy(fresh, turn, 12)  # all of it evaluated again, in other batches
    assert restored == recomputed and np.allclose(restored_logits, recomputed_logits, atol=0.5)
    assert slot.state_cache.take_counts().hits == 1


@needs_llamacpp
def test_a_returning_conversation_is_served_from_the_cache_after_a_restart(smollm2, tmp_path):
    models = '{"smol": {"path": "%s", "engine": "llama.cpp", "context_length": 2048}}' % smollm2
    env = {"KRONK_MODELS": models, "KRONK_PARALLEL": 1, "KRONK_THREADS": 2,
           "KRONK_PROMPT_CACHE_DIR": str(tmp_path / "prompt-cache")}
    document = "The history of the lighthouse keepers of the northern coast. " * 30
    ask = [{"role": "user", "content": document + "\nWho were they?"}]
    with run_server(tmp_path, env) as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="unused")
        first = client.chat.completions.create(model="smol", messages=ask, max_tokens=8, temperature=0)
        client.chat.completions.create(model="smol", max_tokens=4, temperature=0, messages=[
            {"role": "user", "content": "A recipe for bread with flour, water and salt. " * 20}])
        turn = ask + [{"role": "assistant", "content": first.choices[0].message.content},
                      {"role": "user", "content": "And then?"}]
        second = client.chat.completions.create(model="smol", messages=turn, max_tokens=4, temperature=0)
        assert second.usage.prompt_tokens_details.cached_tokens >= 0.9 * first.usage.prompt_tokens
        deadline = time.monotonic() + 30  # counted when the slot is given back, just after the answer
        while metric(server, "kronk_prompt_cache_events_total", model="smol", event="hits") < 1:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert server.stop(graceful=True) == 0  # a restart: the disk writes still waiting are done first
    with run_server(tmp_path, env) as server:  # a new server: RAM is gone, the disk tier is not
        client = OpenAI(base_url=server.url + "/v1", api_key="unused")
        again = client.chat.completions.create(model="smol", messages=turn, max_tokens=4, temperature=0)
        assert again.usage.prompt_tokens_details.cached_tokens >= 0.9 * first.usage.prompt_tokens
        assert again.choices[0].message.content == second.choices[0].message.content


@needs_llamacpp
def test_a_worker_stopped_right_after_an_answer_writes_its_entry_first(smollm2, tmp_path):
    models = '{"smol": {"path": "%s", "engine": "llama.cpp", "context_length": 2048}}' % smollm2
    env = {"KRONK_MODELS": models, "KRONK_PARALLEL": 1, "KRONK_THREADS": 2,
           "KRONK_PROMPT_CACHE_DIR": str(tmp_path / "prompt-cache")}
    ask = [{"role": "user", "content": "The history of the lighthouse keepers of the northern coast. " * 30}]
    with run_server(tmp_path, env) as server:
        first = server.post("/v1/chat/completions", {"model": "smol", "messages": ask, "max_tokens": 4}).json()
        assert server.stop(graceful=True) == 0  # at once: the entry's disk write was still waiting for its time
    with run_server(tmp_path, env) as server:
        again = server.post("/v1/chat/completions", {"model": "smol", "messages": ask, "max_tokens": 4}).json()
        cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= first["usage"]["prompt_tokens"] - 1, again["usage"]


@needs_llamacpp
def test_two_workers_serve_each_others_conversations_from_the_disk_tier(smollm2, tmp_path):
    models = '{"smol": {"path": "%s", "engine": "llama.cpp", "context_length": 2048}}' % smollm2
    env = {"KRONK_MODELS": models, "KRONK_WORKERS": 2, "KRONK_PARALLEL": 1, "KRONK_THREADS": 1,
           "KRONK_PROMPT_CACHE_DIR": str(tmp_path / "prompt-cache")}
    topics = ["lighthouses", "bread", "glaciers", "violins"]
    with run_server(tmp_path, env) as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="unused")

        def saved() -> float:
            return metric(server, "kronk_prompt_cache_events_total", model="smol", event="saved")

        def turn(messages: list[dict]) -> tuple[str, int, int]:
            before = saved()
            reply = client.chat.completions.create(model="smol", messages=messages, max_tokens=4, temperature=0)
            deadline = time.monotonic() + 30  # the state is on disk once the saving is counted
            while saved() <= before:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            usage = reply.usage
            return reply.choices[0].message.content, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens

        chats = [[{"role": "user", "content": f"Facts about {t}. " * 40 + "Summarize."}] for t in topics]
        for chat in chats:
            text, _, _ = turn(chat)
            chat += [{"role": "assistant", "content": text}, {"role": "user", "content": "And then?"}]
        for chat in chats:  # four conversations, two slots in two processes: each later turn found again
            _, prompt, cached = turn(chat)
            assert cached >= 0.9 * prompt


@needs_llamacpp
def test_a_next_turn_sent_at_once_finds_its_prefix_on_one_worker_and_on_two(smollm2, tmp_path):
    models = '{"smol": {"path": "%s", "engine": "llama.cpp", "context_length": 4096}}' % smollm2
    for workers, parallel in ((1, 2), (2, 1)):
        env = {"KRONK_MODELS": models, "KRONK_WORKERS": workers, "KRONK_PARALLEL": parallel, "KRONK_THREADS": 1,
               "KRONK_PROMPT_CACHE_DIR": str(tmp_path / f"cache-{workers}")}
        (tmp_path / f"server-{workers}").mkdir()
        with run_server(tmp_path / f"server-{workers}", env) as server:
            client = OpenAI(base_url=server.url + "/v1", api_key="unused")
            for topic in ("lighthouses", "glaciers"):  # each turn sent as soon as the last answer arrived
                prompt = f"Facts about {topic} and the people who studied them. " * 150
                first = client.chat.completions.create(model="smol", max_tokens=4, temperature=0,
                                                       messages=[{"role": "user", "content": prompt}])
                second = client.chat.completions.create(model="smol", max_tokens=4, temperature=0,
                                                        messages=[{"role": "user", "content": prompt + " and more"}])
                assert first.usage.prompt_tokens > 1200
                assert second.usage.prompt_tokens_details.cached_tokens >= 0.95 * first.usage.prompt_tokens, (
                    workers, topic)
            if workers == 1:  # the next turn took the slot that held its prefix: nothing was restored
                assert metric(server, "kronk_prompt_cache_events_total", model="smol", event="hits") == 0
                # nor saved: each conversation stays in its slot until a prompt overwrites it, which saves it first
                assert metric(server, "kronk_prompt_cache_events_total", model="smol", event="saved") == 0
                client.chat.completions.create(model="smol", max_tokens=4, temperature=0, messages=[
                    {"role": "user", "content": "A recipe for bread with flour, water and salt. " * 150}])
                assert metric(server, "kronk_prompt_cache_events_total", model="smol", event="saved") == 1
                for topic in ("lighthouses", "glaciers"):
                    prompt = f"Facts about {topic} and the people who studied them. " * 150 + " and again"
                    again = client.chat.completions.create(model="smol", max_tokens=4, temperature=0,
                                                           messages=[{"role": "user", "content": prompt}])
                    assert again.usage.prompt_tokens_details.cached_tokens >= 0.95 * again.usage.prompt_tokens


@needs_llamacpp
def test_a_sliding_window_model_reuses_prefixes_and_recomputes_what_its_window_dropped(gemma3, tmp_path):
    engine = llamacpp_engine.LlamaCppEngine("gemma", gemma3, context_length=4096)
    (slot,) = engine.new_slots(1, 2)
    slot.state_cache = PromptCache(engine.state_identity(), 100 * MB, None, 0)
    plain = llamacpp_engine.LlamaCppEngine("gemma", gemma3, context_length=4096)
    (fresh,) = plain.new_slots(1, 2)
    tokenizer = engine.tokenizer
    document = tokenizer.prompt("The history of the lighthouse keepers on the northern coast. " * 90)
    reply, _, _ = greedy(slot, document, 12)
    _, _, reused = greedy(slot, document + reply[:6] + tokenizer.encode(" Then what?"), 4)
    assert reused >= len(document)  # the window still holds what the next tokens attend to
    long = tokenizer.prompt("A recipe for bread with flour, water, salt and time. " * 300)  # past window + batch
    greedy(slot, long, 2)
    early = long[:600] + tokenizer.encode(" Which flour?")  # its window no longer holds tokens 88-600
    answer, _, reused = greedy(slot, early, 8)
    assert reused == 0 and answer == greedy(fresh, early, 8)[0]


@needs_llamacpp
def test_a_sliding_window_state_restored_after_an_eviction_serves_the_next_turn(gemma3, tmp_path):
    engine = llamacpp_engine.LlamaCppEngine("gemma", gemma3, context_length=8192)
    (slot,) = engine.new_slots(1, 2)
    cache = slot.state_cache = PromptCache(engine.state_identity(), 500 * MB, None, 0)
    tokenizer = engine.tokenizer
    prompt = tokenizer.prompt("The history of the lighthouse keepers on the northern coast. " * 200)  # 4x the window
    reply, _, _ = greedy(slot, prompt, 8)
    slot.keep_state()  # the answer is out
    greedy(slot, tokenizer.prompt("A recipe for bread with flour, water, salt and time. " * 100), 2)  # evicts it
    cache.take_counts()
    # The next turn writes the answer back otherwise than it was sampled (as clients do): it leaves the saved
    # prompt-and-answer early, so only the state saved at the prompt's end can serve it.
    turn = prompt + reply[:3] + tokenizer.encode(" (edited) And then?")
    answer, _, reused = greedy(slot, turn, 4)
    counts = cache.take_counts()
    assert reused == len(prompt) - 1 and counts.hits == 1 and counts.restored_tokens == len(prompt) - 1
    plain = llamacpp_engine.LlamaCppEngine("gemma", gemma3, context_length=8192)
    (fresh,) = plain.new_slots(1, 2)
    fresh.prefill(prompt)  # the same calls, so that the numbers are the same to the last bit
    assert answer == greedy(fresh, turn, 4)[0]


@needs_llamacpp
def test_a_sliding_window_prompt_sent_again_after_an_answer_past_its_window_is_restored(gemma3, tmp_path):
    engine = llamacpp_engine.LlamaCppEngine("gemma", gemma3, context_length=4096)
    (slot,) = engine.new_slots(1, 2)
    cache = slot.state_cache = PromptCache(engine.state_identity(), 500 * MB, None, 0)
    tokenizer = engine.tokenizer
    prompt = tokenizer.prompt("The history of the lighthouse keepers on the northern coast. " * 100)
    answer = tokenizer.encode(" A keeper's log, day by day, of lamps, storms and ships." * 100)  # past the window
    greedy(slot, prompt, 2)
    slot.prefill(prompt + answer)  # the slot now cannot be cut back to the prompt's end
    slot.keep_state()
    cache.take_counts()
    _, _, reused = greedy(slot, prompt, 2)  # an agent's next session: the same prompt again
    assert reused == len(prompt) - 1 and cache.take_counts().hits == 1


def test_the_memory_estimate_follows_the_sliding_window(gemma3):
    model = read_gguf(gemma3)
    full_size = 18 * 32768 * (256 + 256) * 2  # every layer over the whole context, as before
    assert kv_cache_bytes(model, 32768) < 0.25 * full_size


def test_a_cache_key_marks_where_its_prompts_part():
    cache = PromptCache("model a", 10 * MB, None, 0)
    system = tokens(20, 3 * BLOCK + 7)
    assert cache.key_branch("team", system + tokens(21, 100)) == 0  # the key's first prompt: nothing to part from
    assert cache.key_branch("team", system + tokens(22, 100)) == 3 * BLOCK  # the shared blocks
    assert cache.key_branch("other", system + tokens(23, 100)) == 0  # another key's prompts are not its
    later = system + tokens(22, 100) + tokens(24, 80)
    assert cache.key_branch("team", later) == 0  # a later turn continues the last prompt


@needs_llamacpp
def test_a_shared_prefix_is_saved_where_conversations_part_and_at_a_breakpoint(smollm2, tmp_path):
    engine = llamacpp_engine.LlamaCppEngine("smol", smollm2, context_length=1024)
    (slot,) = engine.new_slots(1, 2)
    cache = slot.state_cache = PromptCache(engine.state_identity(), 100 * MB, tmp_path, 100 * MB)
    plain = llamacpp_engine.LlamaCppEngine("smol", smollm2, context_length=1024)
    (fresh,) = plain.new_slots(1, 2)
    tokenizer = engine.tokenizer
    system = tokenizer.prompt("You answer questions about lighthouses, briefly and kindly. " * 12)
    # The first conversation goes on well past what the two share: the shared prefix is worth an entry of its own.
    first = system + tokenizer.encode(" Who kept the northern light, for how many winters, and what did they write"
                                      " in the log on the nights the fog came in from the sea?")
    greedy(slot, first, 4)
    slot.keep_state()  # as a session does once the answer is out
    second = system + tokenizer.encode(" How tall was the southern tower?")
    answer, _, reused = greedy(slot, second, 8)
    parted = reused  # where the second left the first: the system prompt and what the two questions share
    assert len(system) <= parted < len(second) and cache.holds(second[:parted])
    fresh.prefill(second[:parted])  # the same calls on a fresh slot (a batch's split changes the last bits)
    assert answer == greedy(fresh, second, 8)[0]
    assert cache.take_counts().saved == 2  # the first conversation, and the prefix the two share
    third = system + tokenizer.encode(" Was the light ever moved?")
    greedy(slot, third, 4)
    assert cache.take_counts().saved == 0  # the prefix is there already: not saved again
    slot.keep_state()  # the answer is out: the prefix's deferred disk write goes with this one
    assert len(list(Path(cache.disk_dir).glob("*" + SUFFIX))) == 3

    document = tokenizer.prompt("A recipe for bread with flour, water and salt. " * 30)
    point = len(document) - 40  # a breakpoint inside the prompt: its prefix is saved on the way
    slot.prefill(document, save_at=[point])
    assert cache.holds(document[:point]) and slot.cache_written == point
    assert int(np.argmax(slot.logits())) == greedy(fresh, document, 1)[0][0]  # the save changed nothing
    slot.prefill(document + tokenizer.encode(" Bake it."), save_at=[10_000])  # at the end: saved with the answer
    assert slot.cache_written == len(tokenizer.encode(" Bake it."))


@needs_llamacpp
def test_a_next_turn_parting_near_the_end_of_the_last_one_saves_nothing_before_its_first_token(smollm2, tmp_path):
    engine = llamacpp_engine.LlamaCppEngine("smol", smollm2, context_length=1024)
    (slot,) = engine.new_slots(1, 2)
    cache = slot.state_cache = PromptCache(engine.state_identity(), 100 * MB, tmp_path, 100 * MB)
    tokenizer = engine.tokenizer
    turn = tokenizer.prompt("Notes on bread: flour, water, salt and time. " * 20)
    greedy(slot, turn + tokenizer.encode(" Summarize."), 4)
    slot.keep_state()  # the last turn and its answer
    assert cache.take_counts().saved == 1
    _, _, reused = greedy(slot, turn + tokenizer.encode(" Summarize, and more."), 4)
    assert reused >= len(turn) and slot.cache_written == 0
    assert cache.take_counts().saved == 0  # the saved turn serves that prefix: no second copy of nearly all of it


@needs_llamacpp
def test_cache_control_breakpoints_save_prefixes_and_usage_says_so(smollm2, tmp_path):
    models = '{"smol": {"path": "%s", "engine": "llama.cpp", "context_length": 2048}}' % smollm2
    env = {"KRONK_MODELS": models, "KRONK_PARALLEL": 1, "KRONK_THREADS": 2,
           "KRONK_PROMPT_CACHE_DIR": str(tmp_path / "prompt-cache")}
    system = [{"type": "text", "text": "You answer questions about lighthouses, briefly. " * 15,
               "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    with run_server(tmp_path, env) as server:
        client = Anthropic(base_url=server.url, api_key="unused")

        def ask(question: str, **fields) -> tuple[dict, int]:
            """The streamed reply's usage (message_start has the same cache split), and the prompt's size."""
            messages = [{"role": "user", "content": question}]
            with client.messages.stream(model="smol", max_tokens=4, system=system, messages=messages,
                                        extra_body={"temperature": 0, **fields}) as stream:
                start = next(event for event in stream if event.type == "message_start").message.usage
                usage = stream.get_final_message().usage
            split = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
            assert [getattr(start, name) for name in split] == [getattr(usage, name) for name in split]
            counted = client.messages.count_tokens(model="smol", system=system, messages=messages).input_tokens
            return usage, counted

        usage, counted = ask("Who kept the northern light?")
        assert usage.cache_read_input_tokens == 0 and 100 < usage.cache_creation_input_tokens < counted
        assert usage.input_tokens + usage.cache_creation_input_tokens == counted
        breakpoint_at = usage.cache_creation_input_tokens
        usage, counted = ask("A different question, about the southern tower?")
        assert usage.cache_creation_input_tokens == 0 and usage.cache_read_input_tokens >= breakpoint_at
        assert usage.input_tokens + usage.cache_read_input_tokens == counted
        usage, counted = ask("And a third one?", cache_control={"type": "ephemeral"})
        assert usage.cache_read_input_tokens >= breakpoint_at  # the whole prompt is saved with its answer
        assert usage.cache_creation_input_tokens == counted - usage.cache_read_input_tokens > 0
        assert usage.input_tokens == 0

        chat = OpenAI(base_url=server.url + "/v1", api_key="unused")

        def saves(system_text: str, breakpoint: bool) -> float:
            """States saved by one chat turn (reported when its slot is given back, all at once)."""
            part = {"type": "text", "text": system_text}
            if breakpoint:
                part["prompt_cache_breakpoint"] = {"mode": "explicit"}
            before = metric(server, "kronk_prompt_cache_events_total", model="smol", event="saved")
            chat.chat.completions.create(model="smol", max_tokens=4, temperature=0, messages=[
                {"role": "system", "content": [part]}, {"role": "user", "content": "Which one is tallest?"}])
            deadline = time.monotonic() + 30
            while (after := metric(server, "kronk_prompt_cache_events_total", model="smol", event="saved")) <= before:
                assert time.monotonic() < deadline
                time.sleep(0.1)
            return after - before

        assert saves("You know every bridge of the river. " * 15, breakpoint=False) == 1  # with its answer
        assert saves("You know every tower of the city. " * 15, breakpoint=True) == 2  # and at OpenAI's breakpoint


@needs_llamacpp
def test_a_stream_the_client_left_logs_the_tokens_it_reused(smollm2, tmp_path):
    models = '{"smol": {"path": "%s", "engine": "llama.cpp", "context_length": 2048}}' % smollm2
    with run_server(tmp_path, {"KRONK_MODELS": models}) as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="unused")
        ask = [{"role": "user", "content": "The history of the lighthouse keepers of the northern coast. " * 20}]
        first = client.chat.completions.create(model="smol", messages=ask, max_tokens=2, temperature=0)
        stream = client.chat.completions.create(model="smol", messages=ask + [
            {"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "More."}],
            max_tokens=500, temperature=0, stream=True, extra_body={"ignore_eos": True})
        next(chunk for chunk in stream if chunk.choices and chunk.choices[0].delta.content)
        stream.close()  # gone after its first token
        deadline = time.monotonic() + 60
        while not (left := [e for e in server.completed() if e.get("outcome") == "client_gone"]):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert left[0]["cached_tokens"] >= first.usage.prompt_tokens
