"""An engine that says what a test tells it to: the real engine, with sampling steered to a script.

At each prompt the slot reads the file named by KRONK_TEST_SCRIPT_FILE and
forces its bytes' tokens one by one (every other logit is -inf), then EOS.
Tokenizing, prefill, decoding and detokenizing stay the real engine's. Used
to make the model write tool calls, which a random tiny model never does.
"""

import os
from pathlib import Path

import numpy as np

from kronk_wsgi.engine.ctransformers_engine import CTransformersEngine, CTransformersSlot


class ScriptedSlot(CTransformersSlot):
    tokenizer = None  # set by ScriptedEngine

    def prefill(self, tokens, cancelled=lambda: False, chunk=32):
        self._start = len(tokens)
        self._script = self._tokens(Path(os.environ["KRONK_TEST_SCRIPT_FILE"]).read_text())
        return super().prefill(tokens, cancelled, chunk)

    def _tokens(self, text: str) -> list[int]:
        """The script as one token per byte (the vocabulary has all 256), then EOS."""
        by_bytes = {self.tokenizer.piece(t): t for t in reversed(range(self._n_vocab))}
        return [by_bytes[bytes([b])] for b in text.encode()] + [self.tokenizer.eos_id]

    def logits(self) -> np.ndarray:
        real = super().logits()
        step = min(len(self.cached) - self._start, len(self._script) - 1)
        forced = np.full_like(real, -np.inf)
        forced[self._script[step]] = 0.0
        return forced


class ScriptedEngine(CTransformersEngine):
    slot_class = ScriptedSlot

    def new_slot(self, threads: int) -> ScriptedSlot:
        slot = super().new_slot(threads)
        slot.tokenizer = self.tokenizer
        return slot
