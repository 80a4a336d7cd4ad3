"""Blending several datasets by weight into one, deterministically.

Sample i goes to the dataset that is furthest behind its quota: the k maximising
`weight_k * max(i, 1) - count_k` (ties to the lowest k), megatron-core's rule (its BlendedDataset's
build_blending_indices), so a blend draws the same member samples in the same order as
megatron-core's. This greedy rule keeps every dataset's count within one sample of `weight_k * n`
after every prefix of n samples, so even a short run sees the intended mix. The assignment depends
only on the weights and the size, never on a seed.

Owns the assignment only; each member dataset does its own shuffling.
"""

import math

import numpy as np

from megazero.core.errors import UsageError


def normalize_weights(weights, expected_count=None):
    """Weights as floats summing to 1; negative, non-finite or all-zero weights raise UsageError."""
    weights = [float(w) for w in weights]
    if expected_count is not None and len(weights) != expected_count:
        raise UsageError(f"{len(weights)} blend weights for {expected_count} datasets; give one weight per dataset")
    if not weights or any(w < 0 or not math.isfinite(w) for w in weights) or sum(weights) <= 0:
        raise UsageError(f"blend weights {weights} must be non-negative with a positive sum")
    # As megatron-core normalises (numpy float64 sum), so the blend's arithmetic is bit-equal.
    return (np.array(weights, dtype=np.float64) / np.sum(np.array(weights, dtype=np.float64))).tolist()


def build_blend_indices(weights, size):
    """(dataset_index, dataset_sample_index) arrays of length `size` by the greedy rule above."""
    dataset_index = np.empty(size, dtype=np.int64)
    dataset_sample_index = np.empty(size, dtype=np.int64)
    counts = [0] * len(weights)
    candidates = range(len(weights))
    # A plain Python loop: a handful of datasets and ~1 µs per sample, built once per run.
    for i in range(size):
        chosen = max(candidates, key=lambda k: weights[k] * max(i, 1) - counts[k])
        dataset_index[i] = chosen
        dataset_sample_index[i] = counts[chosen]
        counts[chosen] += 1
    return dataset_index, dataset_sample_index


class BlendedDataset:
    """`size` samples drawn from `datasets` in proportion to `weights` (normalised here)."""

    def __init__(self, datasets, weights, size):
        if not datasets:
            raise UsageError("a blend needs at least one dataset")
        self.datasets = list(datasets)
        self.weights = normalize_weights(weights, expected_count=len(self.datasets))
        self.size = int(size)
        self.dataset_index, self.dataset_sample_index = build_blend_indices(self.weights, self.size)
        needed = np.bincount(self.dataset_index, minlength=len(self.datasets))
        for k, dataset in enumerate(self.datasets):
            if needed[k] > len(dataset):
                raise UsageError(
                    f"blend needs {needed[k]} samples from dataset {k} but it has "
                    f"{len(dataset)}; build it with more samples"
                )

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        if not -self.size <= index < self.size:
            raise IndexError(f"sample {index} out of range for {self.size} samples")
        k = int(self.dataset_index[index])
        return self.datasets[k][int(self.dataset_sample_index[index])]
