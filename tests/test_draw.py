"""The C draw against a full sort in float64: the same kept tokens, each drawn in proportion.

u runs over an even grid instead of random numbers, so each token's share of
the grid must match its probability to within one grid step.
"""

import ctypes

import numpy as np
import pytest

from kronk_wsgi.engine._draw import draw

GRID = 4_000


def reference(logits: np.ndarray, inverse_temperature: float, top_k: int, top_p: float, min_p: float):
    """The kept tokens (in order: highest logit first, ties by lower id) and their probabilities, by sorting."""
    values = np.where(np.isnan(logits), -np.inf, logits).astype(np.float64)
    order = np.lexsort((np.arange(len(values)), -values))
    weights = np.exp((values[order] - values[order[0]]) * inverse_temperature)
    keep = min(top_k, len(order)) if top_k else len(order)
    if top_p < 1:  # the first tokens whose weight reaches top_p of the top_k tokens' weight
        keep = min(keep, int(np.searchsorted(np.cumsum(weights[:keep]), top_p * weights[:keep].sum())) + 1)
    if min_p > 0:  # the heaviest weighs 1
        keep = min(keep, max(1, int(np.count_nonzero(weights[:keep] >= min_p))))
    kept, weights = order[:keep], weights[:keep]
    return kept[weights > 0], weights[weights > 0] / weights.sum()


def shares(logits: np.ndarray, *params) -> np.ndarray:
    """Each token's share of an even grid of u."""
    drawn = [draw(logits, *params, (i + 0.5) / GRID) for i in range(GRID)]
    return np.bincount(drawn, minlength=len(logits)) / GRID


rng = np.random.default_rng(3)
VOCAB = 49152
PEAKED = (rng.standard_normal(VOCAB) * 2).astype(np.float32)
PEAKED[:50] += 8  # a few likely tokens: the cuts fall among the heaviest
FLAT = (rng.standard_normal(VOCAB) * 0.1).astype(np.float32)  # the filters keep thousands, the cuts fall deep
WIDE = (rng.standard_normal(VOCAB) * 3).astype(np.float32)
MASKED = PEAKED.copy()
MASKED[rng.choice(VOCAB, VOCAB // 3, replace=False)] = -np.inf  # a grammar's mask
MASKED[:10] = np.nan
TIED = np.repeat(np.arange(8, dtype=np.float32), 37)[::-1].copy()  # runs of equal logits, heaviest first


@pytest.mark.parametrize("logits", [PEAKED, FLAT, WIDE, MASKED, TIED], ids=["peaked", "flat", "wide", "masked", "tied"])
@pytest.mark.parametrize("params", [
    (1.0, 0, 1.0, 0.0), (1 / 0.7, 0, 1.0, 0.0), (1.0, 0, 0.95, 0.0), (1.0, 0, 0.999, 0.0), (1 / 0.7, 0, 0.9, 0.0),
    (1.0, 40, 1.0, 0.0), (1.0, 5000, 1.0, 0.0), (1.0, 0, 1.0, 0.05), (1.0, 0, 1.0, 1e-4), (1.0, 40, 0.5, 0.0),
    (1.0, 1000, 0.9, 0.01), (1.0, 0, 0.3, 0.0), (4.0, 10, 0.8, 0.2),
], ids=str)
def test_draw_keeps_what_a_full_sort_keeps_in_proportion(logits, params):
    kept, probs = reference(logits, *params)
    got = shares(logits, *params)
    drawn = set(np.flatnonzero(got).tolist())
    assert drawn <= set(kept.tolist())
    assert np.all(np.abs(got[kept] - probs) <= 1 / GRID + 1e-6)


def test_ties_at_a_cut_keep_the_lower_ids():
    logits = np.full(1000, -np.inf, dtype=np.float32)
    logits[500:] = 1.0  # 500 equal tokens: top_k keeps the first ten, top_p the first 1%
    assert set(np.flatnonzero(shares(logits, 1.0, 10, 1.0, 0.0)).tolist()) == set(range(500, 510))
    assert set(np.flatnonzero(shares(logits, 1.0, 0, 0.01, 0.0)).tolist()) == set(range(500, 505))


def test_a_temperature_near_zero_draws_among_the_best_only():
    logits = np.array([1.0, 3.0, 2.0, 3.0], dtype=np.float32)
    assert set(np.flatnonzero(shares(logits, float(np.finfo(np.float32).max), 0, 1.0, 0.0)).tolist()) == {1, 3}


def test_logits_lent_by_ctypes_are_taken_as_they_are():
    """llama.cpp's logits come through ctypes, whose buffers say "<f" where numpy's say "f"."""
    block = (ctypes.c_float * 4)(0.0, 1.0, 3.0, 2.0)
    logits = np.ctypeslib.as_array(ctypes.cast(block, ctypes.POINTER(ctypes.c_float)), shape=(4,))
    assert memoryview(logits).format != "f"
    assert draw(logits, 1.0, 1, 1.0, 0.0, 0.5) == 2


def test_the_last_weight_is_reached_at_the_top_of_the_grid():
    logits = np.full(1000, -np.inf, dtype=np.float32)
    logits[[3, 997]] = 0.0
    assert draw(logits, 1.0, 0, 1.0, 0.0, 0.0) == 3
    assert draw(logits, 1.0, 0, 1.0, 0.0, np.nextafter(1.0, 0.0)) == 997


@pytest.mark.parametrize("logits, error", [
    (np.full(10, -np.inf, dtype=np.float32), ValueError),
    (np.full(10, np.nan, dtype=np.float32), ValueError),
    (np.array([0.0, np.inf], dtype=np.float32), ValueError),
    (np.zeros(10, dtype=np.float64), TypeError),
    (np.zeros(10, dtype=">f4" if np.little_endian else "<f4"), TypeError),  # not this machine's byte order
    (np.zeros(0, dtype=np.float32), TypeError),
    (np.zeros(20, dtype=np.float32)[::2], ValueError),  # not contiguous
    ([0.0, 1.0], TypeError),
])
def test_logits_that_cannot_be_drawn_from_are_refused(logits, error):
    with pytest.raises(error):
        draw(logits, 1.0, 0, 1.0, 0.0, 0.5)


@pytest.mark.parametrize("params", [(0.0, 0, 1.0, 0.0, 0.5), (float("inf"), 0, 1.0, 0.0, 0.5),
                                    (1.0, 0, 1.0, 0.0, 1.0), (1.0, 0, 1.0, 0.0, -0.1), (1.0, 0, 1.0, 1.5, 0.5)])
def test_parameters_out_of_range_are_refused(params):
    with pytest.raises(ValueError):
        draw(np.zeros(10, dtype=np.float32), *params)
