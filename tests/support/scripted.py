"""An engine that says what a test tells it to: the real engine, with sampling steered to a script.

At each prompt the slot reads the file named by KRONK_TEST_SCRIPT_FILE and
forces its bytes one by one, then EOS: only the tokens of the next byte keep
their logits (a byte may have two tokens: its byte token and a plain one; a
grammar may allow only one of them). A script that ends with FREE leaves the
model free after its text: the real logits follow; with ENDLESS, the real logits
but EOS, so the model writes on until max_tokens (or until the server ends it).
Tokenizing, prefill, decoding and detokenizing stay the real engine's. Used
to make the model write tool calls, which a random tiny model never does. A script of parts joined by NEXT
is taken a part a prompt (the last part stays), for a request that prompts the model more than once.
"""

import contextlib
import dataclasses
import os
from pathlib import Path
from typing import Iterator

import numpy as np

from kronk_wsgi.engine import ctransformers_engine
from kronk_wsgi.engine.ctransformers_engine import CTransformersEngine, CTransformersSlot
from kronk_wsgi.testing import Server, models_config, run_server

FREE = "<<free>>"
ENDLESS = "<<endless>>"
NEXT = "<<next>>"


class ScriptedSlot(CTransformersSlot):
    tokenizer = None  # set by ScriptedEngine

    def evaluate(self, tokens, cancelled=lambda: False, chunk=None):
        self._start = len(tokens)
        path = Path(os.environ["KRONK_TEST_SCRIPT_FILE"])
        script, *rest = path.read_text().split(NEXT)
        if rest:
            path.write_text(NEXT.join(rest))
        self._endless = script.endswith(ENDLESS)
        self._free = script.endswith(FREE) or self._endless
        self._script = self._tokens(script.removesuffix(FREE).removesuffix(ENDLESS))
        super().evaluate(tokens, cancelled, chunk)

    def _tokens(self, text: str) -> list[list[int]]:
        """The script as the tokens of each byte (the vocabulary has all 256), then EOS unless free."""
        by_bytes: dict[bytes, list[int]] = {}
        for t in range(self._n_vocab):
            by_bytes.setdefault(self.tokenizer.piece(t), []).append(t)
        return [by_bytes[bytes([b])] for b in text.encode()] + ([] if self._free else [[self.tokenizer.eos_id]])

    def logits(self) -> np.ndarray:
        real = super().logits()
        step = len(self.cached) - self._start
        if self._free and step >= len(self._script):
            if self._endless:
                real[self.tokenizer.eos_id] = -np.inf
            return real
        step = min(step, len(self._script) - 1)
        forced = np.full_like(real, -np.inf)
        forced[self._script[step]] = real[self._script[step]]
        return forced


class ScriptedEngine(CTransformersEngine):
    slot_class = ScriptedSlot

    def new_slots(self, count: int, threads: int) -> list[ScriptedSlot]:
        slots = super().new_slots(count, threads)
        for slot in slots:
            slot.tokenizer = self.tokenizer
        return slots


KIND = dataclasses.replace(ctransformers_engine.KIND, name="scripted", engine=ScriptedEngine)


@contextlib.contextmanager
def run_scripted(tmp: Path, models: dict, default_model: str) -> Iterator[Server]:
    """A server of ``models`` (each given "engine": this module's KIND to follow the script) whose
    ``say(*texts)`` sets what the scripted models write next (each text for one prompt, the last for the rest)."""
    script = tmp / "script.txt"
    script.write_text("")
    env = {"KRONK_CONFIG": str(models_config(tmp / "models.toml", models)), "KRONK_DEFAULT_MODEL": default_model,
           "KRONK_TEST_SCRIPT_FILE": str(script)}
    with run_server(tmp, env) as server:
        server.say = lambda *texts: script.write_text(NEXT.join(texts))
        yield server
