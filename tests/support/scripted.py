"""An engine that says what a test tells it to: the real engine, with sampling steered to a script.

At each prompt the slot reads the file named by KRONK_TEST_SCRIPT_FILE and
forces its tokens one by one (every other logit is -inf), then EOS.
Tokenizing, prefill, decoding and detokenizing stay the real engine's. Used
to make the model write tool calls, which a random tiny model never does.
"""

import ctypes
import os
from pathlib import Path

import numpy as np

from kronk_wsgi.engine.ctransformers_engine import CTransformersEngine, CTransformersSlot


class ScriptedSlot(CTransformersSlot):
    def prefill(self, tokens, cancelled=lambda: False, chunk=32):
        self._start = len(tokens)
        self._script = self._tokens(Path(os.environ["KRONK_TEST_SCRIPT_FILE"]).read_text())
        return super().prefill(tokens, cancelled, chunk)

    def _tokens(self, text: str) -> list[int]:
        """The script's tokens, on this slot's own model object (it is used by one thread only)."""
        data = text.encode()
        buffer = (ctypes.c_int * (len(data) + 4))()
        tokens = buffer[: self._llm.ctransformers_llm_tokenize(data, False, buffer)]
        if tokens and self.token_bytes(tokens[0]) == b" " and not text.startswith(" "):
            tokens = tokens[1:]  # SentencePiece's leading space is not part of the script
        return tokens + [self._llm.eos_token_id]

    def logits(self) -> np.ndarray:
        real = super().logits()
        step = min(len(self.cached) - self._start, len(self._script) - 1)
        forced = np.full_like(real, -np.inf)
        forced[self._script[step]] = 0.0
        return forced


class ScriptedEngine(CTransformersEngine):
    slot_class = ScriptedSlot
