"""Choosing the next token from logits, in Python, with a per-request RNG.

ctransformers' C sampler reseeds on every call and divides by zero at
temperature 0 (docs/ENGINES.rst); sampling here avoids both and gives
min_p, presence/frequency penalties and logit_bias as well.
"""

import dataclasses
import secrets
from collections import Counter
from typing import Optional

import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens; defaults follow OpenAI's API."""

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off; llama.cpp style, over the last 64 tokens
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: Optional[int] = None  # None = fresh entropy


REPETITION_WINDOW = 64
# The filters (top_p, min_p) look at this many of the most likely tokens first: sorting a
# whole 49k vocabulary takes ~5 ms. Only when they keep all of them is everything sorted.
CANDIDATES = 256
DRAW_BLOCK = 256  # tokens summed at once when drawing (see Sampler._draw)


class Sampler:
    """Samples one reply's tokens; owns that reply's RNG."""

    def __init__(self, params: SamplingParams, prompt: list[int], choice: int = 0) -> None:
        self.params = params
        # Any integer is a seed (OpenAI's API allows negative ones); numpy takes 0 <= seed.
        seed = params.seed % 2**64 if params.seed is not None else secrets.randbits(64)
        # Each choice of one request draws its own numbers; the first draws what a request of one choice would.
        self._rng = np.random.default_rng(seed if choice == 0 else [seed, choice])
        self._recent = list(prompt[-REPETITION_WINDOW:])
        self._counts: Counter[int] = Counter()

    def sample(self, logits: np.ndarray, allowed: Optional[np.ndarray] = None) -> int:
        """Pick the next token, among the ``allowed`` ones if given, and remember it for the penalties."""
        p = self.params
        logits = np.array(logits, dtype=np.float32)  # a copy, in the engine's precision
        if allowed is not None:
            logits[~allowed] = -np.inf
        for token, bias in p.logit_bias:
            logits[token] += bias
        if p.repetition_penalty != 1.0 and self._recent:
            seen = np.unique(self._recent)
            values = logits[seen]
            logits[seen] = np.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and self._counts:
            tokens = np.fromiter(self._counts.keys(), dtype=np.int64)
            counts = np.fromiter(self._counts.values(), dtype=np.float64)
            logits[tokens] -= p.presence_penalty + p.frequency_penalty * counts
        token = self._choose(logits)
        self._recent = (self._recent + [token])[-REPETITION_WINDOW:]
        self._counts[token] += 1
        return token

    def _choose(self, logits: np.ndarray) -> int:
        """The next token from the adjusted logits (a scratch copy: it is changed)."""
        p = self.params
        if p.temperature == 0:
            return int(np.argmax(logits))
        if p.temperature != 1.0:
            logits /= p.temperature
        if p.top_k <= 0 and p.top_p >= 1.0 and p.min_p <= 0.0:  # no filter, no sort
            logits -= logits.max()
            return self._draw(np.exp(logits, out=logits))
        if p.top_k > 0:  # the filters work on the top k, their probabilities renormalised
            order = _most_likely(logits, p.top_k)
            probs = np.exp(logits[order] - logits[order[0]])
            probs /= probs.sum()
        else:  # the most likely candidates first, with their probabilities among all tokens
            order = _most_likely(logits, CANDIDATES)
            best = logits[order[0]]
            probs = np.exp(logits[order] - best) / np.exp(logits - best).sum()
        keep = self._kept(probs)
        if keep == len(order) < len(logits) and p.top_k <= 0:  # the filters keep more than the candidates
            order = _most_likely(logits, len(logits))
            probs = np.exp(logits[order] - logits[order[0]])
            probs /= probs.sum()
            keep = self._kept(probs)
        return int(order[self._draw(probs[:keep])])

    def _kept(self, probs: np.ndarray) -> int:
        """How many of the most likely tokens (``probs``, best first) top_p and min_p keep."""
        p = self.params
        keep = len(probs)
        if p.top_p < 1.0:
            keep = min(keep, int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1)
        if p.min_p > 0.0:
            keep = min(keep, max(1, int(np.count_nonzero(probs >= p.min_p * probs[0]))))
        return keep

    def _draw(self, weights: np.ndarray) -> int:
        """An index drawn with probability proportional to ``weights``; never one of weight 0.

        The running sum goes block by block, then within the block drawn: over a whole
        49k vocabulary it took 0.6 ms a token.
        """
        whole = len(weights) - len(weights) % DRAW_BLOCK
        sums = weights[:whole].reshape(-1, DRAW_BLOCK).sum(axis=1, dtype=np.float64)
        if whole < len(weights):
            sums = np.append(sums, weights[whole:].sum(dtype=np.float64))
        cumulative = np.cumsum(sums)
        target = min(self._rng.random() * cumulative[-1], np.nextafter(cumulative[-1], 0.0))
        block = int(np.searchsorted(cumulative, target, side="right"))  # its weights sum to more than 0
        start = block * DRAW_BLOCK
        within = weights[start : start + DRAW_BLOCK]
        rest = target - (cumulative[block - 1] if block else 0.0)
        index = int(np.searchsorted(np.cumsum(within, dtype=np.float64), rest, side="right"))
        if index == len(within):  # the block's sum rounded above its running sum: its last token of weight > 0
            index = int(np.flatnonzero(within)[-1])
        return start + index


def _most_likely(logits: np.ndarray, n: int) -> np.ndarray:
    """The ``n`` highest-scoring tokens (all, if there are fewer), best first."""
    best = np.argpartition(-logits, n - 1)[:n] if n < len(logits) else np.arange(len(logits))
    return best[np.argsort(-logits[best], kind="stable")]


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
