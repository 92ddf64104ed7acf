"""Choosing the next token from logits, with a per-request RNG.

ctransformers' C sampler reseeds on every call and divides by zero at
temperature 0 (docs/ENGINES.rst); sampling here avoids both and gives
min_p, presence/frequency penalties and logit_bias as well. The penalties,
bias and grammar mask are applied here; the draw itself, filters included,
is the C extension ``_draw`` (a whole vocabulary in tens of microseconds).
"""

import dataclasses
import math
import secrets
from collections import Counter
from typing import Optional

import numpy as np

from ._draw import draw


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens; defaults follow OpenAI's API."""

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off; llama.cpp style, over the last repetition_window tokens
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: Optional[int] = None  # None = fresh entropy
    repetition_window: int = 64  # tokens the repetition penalty looks back over, the prompt's included


WHOLE_CONTEXT = 1 << 30  # a repetition window that covers any context (a -1 in llama-server's and Ollama's APIs)

# The largest and smallest 1/temperature a float32 holds: a lower temperature is as good as greedy, with ties
# drawn; a higher one as flat as the draw's precision makes any.
MAX_INVERSE_TEMPERATURE = float(np.finfo(np.float32).max)
MIN_INVERSE_TEMPERATURE = float(np.finfo(np.float32).tiny)
# The penalties' bounds: past them, a penalized logit leaves what a float32 holds.
MAX_PENALTY = 100.0
MIN_REPETITION_PENALTY = 1e-3


def sampling_problem(params: SamplingParams) -> Optional[tuple[str, str]]:
    """The field whose value this sampler cannot take, and why; None if it takes them all. Every protocol's
    sampling fields come here, whatever bounds its own API sets."""
    if not (math.isfinite(params.temperature) and params.temperature >= 0):
        return "temperature", "must be a finite number, 0 or more"
    for name in ("top_p", "min_p"):
        if not 0 <= getattr(params, name) <= 1:
            return name, "must be between 0 and 1"
    if params.top_k < 0:
        return "top_k", "must be 0 (off) or more"
    if not MIN_REPETITION_PENALTY <= params.repetition_penalty <= MAX_PENALTY:
        return "repetition_penalty", f"must be between {MIN_REPETITION_PENALTY:g} and {MAX_PENALTY:g}"
    for name in ("presence_penalty", "frequency_penalty"):
        if not abs(getattr(params, name)) <= MAX_PENALTY:
            return name, f"must be between {-MAX_PENALTY:g} and {MAX_PENALTY:g}"
    if any(math.isnan(bias) or bias == math.inf or abs(bias) > MAX_PENALTY and bias != -math.inf
           for _, bias in params.logit_bias):
        return "logit_bias", f"a bias must be between {-MAX_PENALTY:g} and {MAX_PENALTY:g}, or a ban"
    return None


class Sampler:
    """Samples one reply's tokens; owns that reply's RNG."""

    def __init__(self, params: SamplingParams, prompt: list[int], choice: int = 0) -> None:
        self.params = params
        # Any integer is a seed (OpenAI's API allows negative ones); numpy takes 0 <= seed.
        seed = params.seed % 2**64 if params.seed is not None else secrets.randbits(64)
        # Each choice of one request draws its own numbers; the first draws what a request of one choice would.
        self._rng = np.random.default_rng(seed if choice == 0 else [seed, choice])
        self._window = params.repetition_window
        # An image's placeholders (negative ids) are no tokens to penalize.
        self._recent = [token for token in prompt[-self._window:] if token >= 0] if self._window else []
        self._counts: Counter[int] = Counter()

    def sample(self, logits: np.ndarray, allowed: Optional[np.ndarray] = None) -> int:
        """Pick the next token, among the ``allowed`` ones if given, and remember it for the penalties."""
        p = self.params
        logits = np.ascontiguousarray(logits)  # as the draw takes it (asking for float32 would copy ctypes' <f4)
        if logits.dtype != np.float32:
            logits = logits.astype(np.float32)  # the engine's precision
        repeated = p.repetition_penalty != 1.0 and self._recent
        counted = (p.presence_penalty or p.frequency_penalty) and self._counts
        if allowed is not None or p.logit_bias or repeated or counted:
            logits = logits.copy()
        if allowed is not None:
            logits[~allowed] = -np.inf
        for token, bias in p.logit_bias:
            logits[token] += bias
        if repeated:
            seen = np.unique(self._recent)
            values = logits[seen]
            logits[seen] = np.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if counted:
            tokens = np.fromiter(self._counts.keys(), dtype=np.int64)
            counts = np.fromiter(self._counts.values(), dtype=np.float64)
            logits[tokens] -= p.presence_penalty + p.frequency_penalty * counts
        if p.temperature == 0:
            token = int(np.argmax(logits))
        else:
            inverse_temperature = min(max(1.0 / p.temperature, MIN_INVERSE_TEMPERATURE), MAX_INVERSE_TEMPERATURE)
            top_k = min(p.top_k, len(logits))
            token = draw(logits, inverse_temperature, top_k, p.top_p, p.min_p, self._rng.random())
        if self._window:
            self._recent = (self._recent + [token])[-self._window:]
        self._counts[token] += 1
        return token


def logprobs(logits: np.ndarray, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """The model's log probability of ``token``, and the ``top`` most likely tokens with theirs.

    From the model's own distribution: before temperature, penalties, bias and grammar.
    """
    shifted = logits.astype(np.float64) - logits.max()
    log_probs = shifted - np.log(np.exp(shifted).sum())
    top = min(top, len(log_probs))
    best = np.argpartition(-log_probs, top - 1)[:top] if top else np.zeros(0, dtype=np.int64)
    best = best[np.argsort(-log_probs[best], kind="stable")]
    return float(log_probs[token]), [(int(t), float(log_probs[t])) for t in best]
