"""The seeded generators of many clients at once, with the same streams as ``np.random.default_rng(key)``.

A client's batch plan draws from ``np.random.default_rng([seed, round, client, epoch])``: any process (the
simulator, a Flower node) makes the same plan for the same client. Building that generator costs about 40 us, most
of it numpy's ``SeedSequence`` hashing the key word by word in Python; a round of 1,000 clients and 3 epochs builds
3,000 of them. :func:`seed_words` runs the same hash for all keys at once in numpy's uint32 arithmetic (SeedSequence's
pool of 4 words, its constants ``INIT_A``, ``MULT_A``, ``MIX_MULT_L``, ``MIX_MULT_R``, ``INIT_B``, ``MULT_B``, shift
16), and :class:`PlanSeeds` hands its words to ``PCG64`` the way ``SeedSequence.generate_state(4, uint64)`` would.
A test holds the words and the streams against numpy's own for random keys.

Keys are 4 non-negative integers under 2**32 (one uint32 word each, as SeedSequence reads them); any other key
goes to ``np.random.default_rng`` itself."""

from __future__ import annotations

import numpy as np
from numpy.random.bit_generator import ISeedSequence

_MASK = 0xFFFFFFFF
_INIT_A, _MULT_A, _INIT_B, _MULT_B = 0x43B0D7E5, 0x931E8875, 0x8B51F9DD, 0x58F38DED
_MIX_L, _MIX_R = 0xCA01F9DD, 0x4973F715
_POOL = 4


def seed_words(keys: np.ndarray) -> np.ndarray:
    """``[N, 4]`` uint64: ``SeedSequence(list(key)).generate_state(4, np.uint64)`` of each row of ``keys [N, 4]``
    (integers in ``[0, 2**32)``)."""
    ent = np.asarray(keys, dtype=np.uint32)
    const = [_INIT_A]  # the hash constant advances with every call, the same for every row

    def hashmix(v: np.ndarray) -> np.ndarray:
        v = v ^ np.uint32(const[0])
        const[0] = (const[0] * _MULT_A) & _MASK
        v = v * np.uint32(const[0])
        return v ^ (v >> np.uint32(16))

    def mix(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        r = x * np.uint32(_MIX_L) - y * np.uint32(_MIX_R)
        return r ^ (r >> np.uint32(16))

    pool = [hashmix(ent[:, i]) for i in range(_POOL)]
    for src in range(_POOL):
        for dst in range(_POOL):
            if src != dst:
                pool[dst] = mix(pool[dst], hashmix(pool[src]))
    out = np.empty((len(ent), 2 * _POOL), dtype=np.uint32)
    h = _INIT_B
    for i in range(2 * _POOL):
        v = pool[i % _POOL] ^ np.uint32(h)
        h = (h * _MULT_B) & _MASK
        v = v * np.uint32(h)
        out[:, i] = v ^ (v >> np.uint32(16))
    return out.view("<u8")


class _Words(ISeedSequence):
    """A seed sequence whose state is already hashed (what ``PCG64`` asks of it)."""

    def __init__(self, words: np.ndarray):
        self.words = words

    def generate_state(self, n_words: int, dtype=np.uint32) -> np.ndarray:
        return self.words


class PlanSeeds:
    """The generators ``np.random.default_rng([seed, rnd, cid, e])`` for clients ``cids`` and epochs ``0 ..
    epochs-1``, hashed at once; :meth:`rng` of any other (client, epoch) builds it the usual way."""

    def __init__(self, seed: int, rnd: int, cids, epochs: int):
        cids = np.asarray(cids, dtype=np.int64).reshape(-1)
        self.seed, self.rnd, self.epochs = int(seed), int(rnd), int(epochs)
        self.row = {int(c): i for i, c in enumerate(cids)}
        self.words = None
        key_ends = (self.seed, self.rnd, self.epochs, int(cids.min()), int(cids.max())) if len(cids) else ()
        if key_ends and self.epochs > 0 and all(0 <= v <= _MASK for v in key_ends):  # one uint32 word each
            keys = np.empty((len(cids), self.epochs, 4), dtype=np.int64)
            keys[..., 0], keys[..., 1] = self.seed, self.rnd
            keys[..., 2], keys[..., 3] = cids[:, None], np.arange(self.epochs)[None]
            self.words = seed_words(keys.reshape(-1, 4)).reshape(len(cids), self.epochs, 4)

    def rng(self, cid: int, e: int) -> np.random.Generator:
        i = self.row.get(int(cid))
        if self.words is None or i is None or e >= self.epochs:
            return np.random.default_rng([self.seed, self.rnd, int(cid), int(e)])
        return np.random.Generator(np.random.PCG64(_Words(self.words[i, e])))
