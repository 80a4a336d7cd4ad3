"""megazero/data/blended_dataset.py: the blend's counts stay within one of the target at every
prefix; items, and bad weights refused."""

import numpy as np
import pytest

from megazero.core.errors import UsageError
from megazero.data.blended_dataset import BlendedDataset, build_blend_indices


@pytest.mark.parametrize("weights", [[0.5, 0.3, 0.2], [7, 3], [1, 1, 1, 1, 1], [0.999, 0.001], [0.0, 1.0]])
def test_blend_counts_within_one_of_target_at_every_prefix(weights):
    size = 2000
    dataset_index, sample_index = build_blend_indices(list(np.array(weights) / sum(weights)), size)
    counts = np.cumsum(np.eye(len(weights), dtype=np.int64)[dataset_index], axis=0)
    targets = np.outer(np.arange(1, size + 1), np.array(weights) / sum(weights))
    assert np.all(np.abs(counts - targets) <= 1.0 + 1e-9)
    for k in range(len(weights)):  # each dataset's samples are taken in order 0, 1, 2, ...
        assert sample_index[dataset_index == k].tolist() == list(range(int((dataset_index == k).sum())))


def test_blended_dataset_items_and_bad_weights():
    a, b = [("a", i) for i in range(10)], [("b", i) for i in range(10)]
    blend = BlendedDataset([a, b], [3, 1], 8)
    # By hand, megatron-core's lag w*max(i, 1) - count: i=0 (.75,.25) a; i=1 (-.25,.25) b;
    # i=2 (.5,-.5) a; i=3 (.25,-.25) a; i=4 (0,0) tie -> a
    assert [blend[i] for i in range(5)] == [("a", 0), ("b", 0), ("a", 1), ("a", 2), ("a", 3)]
    for weights in ([-1, 2], [0, 0], [1]):
        with pytest.raises(UsageError, match="weight"):
            BlendedDataset([a, b], weights, 8)
    with pytest.raises(UsageError, match="has 10"):
        BlendedDataset([a, b], [1, 1], 40)
