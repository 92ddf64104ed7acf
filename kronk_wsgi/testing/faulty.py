"""A fault-injecting engine for tests: the real ctransformers engine, plus delays and failures.

Faults come from the environment of the server process:
KRONK_TEST_STEP_DELAY (seconds per decoded token), KRONK_TEST_PREFILL_DELAY
(seconds per prefill chunk), KRONK_TEST_FAIL_AFTER (raise after N decoded tokens),
KRONK_TEST_NO_EOS=1 (never end by EOS: for protocols without logit_bias).
Used for fault injection only; every other test runs the plain engine.
"""

import dataclasses
import os
from typing import Sequence

from gevent import monkey

from kronk_wsgi.engine.base import EngineError
from kronk_wsgi.engine import ctransformers_engine
from kronk_wsgi.engine.ctransformers_engine import CTransformersEngine, CTransformersSlot


# The worker threads are real OS threads: sleep for real, not gevent's patched sleep.
sleep = monkey.get_original("time", "sleep")


class FaultySlot(CTransformersSlot):
    def __init__(self, llm, threads: int, prefill_chunk: int) -> None:
        super().__init__(llm, threads, prefill_chunk)
        self.step_delay = float(os.environ.get("KRONK_TEST_STEP_DELAY", "0"))
        self.prefill_delay = float(os.environ.get("KRONK_TEST_PREFILL_DELAY", "0"))
        self.fail_after = int(os.environ.get("KRONK_TEST_FAIL_AFTER", "-1"))
        self.prompt_length = 0

    def evaluate(self, tokens, cancelled=lambda: False, chunk=None):
        self.prompt_length = len(tokens)
        super().evaluate(tokens, cancelled, 8 if self.prefill_delay else chunk)

    def _eval(self, tokens: Sequence[int], n_past: int, pick=None) -> None:
        decoded = n_past - self.prompt_length + 1
        if len(tokens) == 1 and n_past >= self.prompt_length:
            sleep(self.step_delay)
            if 0 <= self.fail_after <= decoded:
                raise EngineError("injected engine failure")
        else:
            sleep(self.prefill_delay)
        super()._eval(tokens, n_past)


class FaultyEngine(CTransformersEngine):
    slot_class = FaultySlot

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if os.environ.get("KRONK_TEST_NO_EOS") == "1":
            self.tokenizer.end_ids = frozenset()


KIND = dataclasses.replace(ctransformers_engine.KIND, name="faulty", engine=FaultyEngine)
