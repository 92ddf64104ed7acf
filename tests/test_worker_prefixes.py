"""What a gRPC worker was sent, for the cache-aware choice of a worker: found at block boundaries, in a scope's own
chain, forgotten oldest first past its budget."""

from kronk_wsgi.engine.prompt_cache import BLOCK
from kronk_wsgi.engine.worker_prefixes import WorkerPrefixes, prompt_hashes


def longest(prefixes: WorkerPrefixes, tokens, scope: str = "") -> int:
    return prefixes.longest(prompt_hashes(tokens, scope))


def test_a_prompt_is_found_by_the_whole_blocks_it_shares_with_a_sequence_sent():
    prefixes = WorkerPrefixes(budget=100 * BLOCK)
    sent = list(range(3 * BLOCK + 10))
    prefixes.add(sent, "")
    assert longest(prefixes, sent) == 3 * BLOCK
    assert longest(prefixes, sent + [7] * BLOCK) == 3 * BLOCK  # a later turn continues it
    assert longest(prefixes, sent[:2 * BLOCK] + [-1] * BLOCK) == 2 * BLOCK  # parts from it in the third block
    assert longest(prefixes, [-1] + sent) == 0
    assert longest(prefixes, sent[:BLOCK - 1]) == 0  # shorter than a block
    assert prefixes.add(sent[:BLOCK - 1], "") is None


def test_another_scopes_sequences_are_not_found():
    prefixes = WorkerPrefixes(budget=100 * BLOCK)
    sent = list(range(2 * BLOCK))
    prefixes.add(sent, "tenant-a")
    assert longest(prefixes, sent, "tenant-a") == 2 * BLOCK
    assert longest(prefixes, sent, "tenant-b") == 0


def test_a_reply_replaces_its_prompt_and_the_oldest_sequences_go_past_the_budget():
    prefixes = WorkerPrefixes(budget=4 * BLOCK)
    prompt = [1] * (2 * BLOCK)
    key = prefixes.add(prompt, "")
    prefixes.add(prompt + [2] * BLOCK, "", replacing=key)
    assert prefixes.blocks == 3  # the prompt's blocks are counted once, in its reply's sequence
    other = [3] * (2 * BLOCK)
    prefixes.add(other, "")  # 5 blocks > 4: the oldest sequence goes
    assert prefixes.blocks == 2
    assert longest(prefixes, prompt) == 0 and longest(prefixes, other) == 2 * BLOCK
    prefixes.add([4] * (6 * BLOCK), "")  # past the budget alone: kept, as the only sequence
    assert prefixes.blocks == 6 and longest(prefixes, other) == 0


def test_a_shared_block_stays_found_while_any_sequence_reaches_it():
    prefixes = WorkerPrefixes(budget=100 * BLOCK)
    system = [9] * BLOCK
    first = prefixes.add(system + [1] * BLOCK, "")
    prefixes.add(system + [2] * BLOCK, "")
    prefixes.add(system, "", replacing=first)  # the first sequence forgotten, the block it shared still reached
    assert longest(prefixes, system + [1] * BLOCK) == BLOCK
    prefixes.clear()
    assert longest(prefixes, system) == 0 and prefixes.blocks == 0
