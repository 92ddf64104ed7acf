"""Saved sequence states, in RAM and on disk: a conversation that comes back after its slot went to another one
restores its history instead of evaluating it again.

An entry is the KV state of one token sequence, as the engine saves it when a slot is about to be overwritten,
or once its answer is out. Every entry belongs to one scope (a tenant: by default each API key is its own) and
one identity (the model file, the engine's version and its context parameters): another scope's or identity's
entries are never restored.

Its parts: the prefix index over blocks of tokens (index.py), the RAM tier (ram.py), the disk tier shared by
workers and servers (disk.py), and the cache that looks both up as one and counts what it did (cache.py).

Slot threads call it at once: a lock (a real one, not gevent's) guards the indexes, held for the indexes only,
never while a file is read, hashed or written. The event loop takes no lock: it reads the counts and the bytes
held. A slot saves its state once its answer is out (the client does not wait for it); its disk write follows
once the slot is given back.
"""

from .cache import PromptCache
from .disk import SUFFIX
from .index import BLOCK, MIN_TOKENS, shared_prefix

__all__ = ["BLOCK", "MIN_TOKENS", "SUFFIX", "PromptCache", "shared_prefix"]
