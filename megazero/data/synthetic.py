"""Random token samples, reproducible by index, for tests and benchmarks that need no corpus."""

from __future__ import annotations

import numpy as np


class SyntheticTokens:
    """Sample i is `seq_length + 1` tokens drawn from a generator seeded with (seed, i)."""

    def __init__(self, vocab_size: int, seq_length: int, seed: int = 0, size: int = 1 << 30):
        self.vocab_size, self.seq_length, self.seed, self.size = vocab_size, seq_length, seed, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict:
        rng = np.random.default_rng([self.seed, index])
        return {"tokens": rng.integers(0, self.vocab_size, self.seq_length + 1, dtype=np.int64)}


class ArithmeticTokens(SyntheticTokens):
    """Learnable samples: sample i is an arithmetic progression modulo the vocabulary with a random
    start and a step in 1..3 (both seeded by (seed, i)). A model learns it within a few steps, so
    gradients carry signal rather than noise: what exactness tests want."""

    def __getitem__(self, index: int) -> dict:
        rng = np.random.default_rng([self.seed, index])
        start, step = rng.integers(0, self.vocab_size), rng.integers(1, 4)
        return {"tokens": (start + step * np.arange(self.seq_length + 1, dtype=np.int64)) % self.vocab_size}


class DocumentTokens(SyntheticTokens):
    """Packed samples for document masking (--mock-data with --reset-position-ids,
    --reset-attention-mask or --eod-mask-loss, as Megatron-LM's mock dataset has documents): sample i
    is documents back to back, each an arithmetic progression modulo the vocabulary (a random start
    and a step in 1..3) of 1 to `max_document` tokens that ends with `eod`, the last one cut by the
    sample's end; seeded by (seed, i). No token but the ends is `eod`."""

    def __init__(
        self,
        vocab_size: int,
        seq_length: int,
        eod: int,
        seed: int = 0,
        size: int = 1 << 30,
        max_document: int | None = None,
    ):
        super().__init__(vocab_size, seq_length, seed, size)
        self.eod, self.max_document = eod, max_document or seq_length

    def __getitem__(self, index: int) -> dict:
        rng = np.random.default_rng([self.seed, index])
        pieces, total = [], 0
        while total < self.seq_length + 1:
            length = int(rng.integers(1, self.max_document + 1))
            start, step = rng.integers(0, self.vocab_size - 1), rng.integers(1, 4)
            body = (start + step * np.arange(length - 1, dtype=np.int64)) % (self.vocab_size - 1)
            body += body >= self.eod  # every id but eod
            pieces.append(np.append(body, self.eod))
            total += length
        return {"tokens": np.concatenate(pieces)[: self.seq_length + 1]}
