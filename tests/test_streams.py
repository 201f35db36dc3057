"""fedhead.core.streams: many clients' plan generators hashed at once give numpy's own streams."""

from __future__ import annotations

import numpy as np

from fedhead.core.engine import LocalConfig, client_plan, local_plan
from fedhead.core.streams import PlanSeeds, seed_words


def test_seed_words_are_seedsequence_state_for_every_key():
    rng = np.random.default_rng(7)
    keys = np.stack([rng.integers(0, 2**32, 500, dtype=np.uint64) for _ in range(4)], 1).astype(np.int64)
    keys[:4] = [[0, 0, 0, 0], [2**32 - 1, 2**32 - 1, 2**32 - 1, 2**32 - 1], [0, 1, 2, 3], [3, 2, 1, 0]]
    got = seed_words(keys)
    for key, words in zip(keys, got):
        np.testing.assert_array_equal(words, np.random.SeedSequence([int(v) for v in key]).generate_state(4, np.uint64))


def test_plan_seeds_give_default_rng_streams_and_fall_back_outside_their_keys():
    seeds = PlanSeeds(11, 4, [9, 2, 700], epochs=2)
    for cid, e in [(9, 0), (9, 1), (2, 0), (700, 1), (700, 2), (5, 0)]:  # (700, 2), (5, 0): not hashed, same stream
        a, b = seeds.rng(cid, e), np.random.default_rng([11, 4, cid, e])
        np.testing.assert_array_equal(a.permutation(37), b.permutation(37))
        np.testing.assert_array_equal(a.random(5, dtype=np.float32), b.random(5, dtype=np.float32))
    big = PlanSeeds(2**40, 1, [3], epochs=1)  # a seed of two words: SeedSequence reads it as such
    assert big.words is None
    np.testing.assert_array_equal(
        big.rng(3, 0).permutation(20), np.random.default_rng([2**40, 1, 3, 0]).permutation(20)
    )


def test_plans_from_plan_seeds_equal_the_client_by_client_plans():
    part = np.arange(100, 173)
    seeds = PlanSeeds(3, 8, [4, 5], epochs=3)
    for got, want in zip(client_plan(part, 3, 8, 5, 3, seeds), client_plan(part, 3, 8, 5, 3)):
        np.testing.assert_array_equal(got, want)
    local = LocalConfig(epochs=3, batch_size=10, steps=12)  # 12 steps of 10 from 73 samples: 2 epochs
    assert local.epochs_drawn([73, 0, 200]) == 2 and LocalConfig(epochs=3).epochs_drawn([5]) == 3
    for got, want in zip(local_plan(part, 3, 8, 4, local, 120, seeds), local_plan(part, 3, 8, 4, local, 120)):
        np.testing.assert_array_equal(got, want)
