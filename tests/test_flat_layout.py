"""The flat bucket layout as plain arithmetic: buckets end at parameter boundaries, chunks are equal
and aligned, and the ranks' local pieces tile every parameter exactly once."""
import pytest

from megazero.zero.flat import CHUNK_ALIGN, FlatLayout


@pytest.mark.parametrize("numels,bucket,shards", [
    ([10, 3, 7, 100, 1], 16, 4), ([5], 1000, 3), ([64, 64, 64], 64, 2), ([1, 1, 1, 1, 1], 2, 8),
])
def test_pieces_tile_every_parameter(numels, bucket, shards):
    layouts = [FlatLayout(numels, bucket, shards, r) for r in range(shards)]
    first = layouts[0]
    for b in first.buckets:
        assert b.size % (shards * CHUNK_ALIGN) == 0 and b.chunk * shards == b.size
        inside = sum(numels[i] for i in b.slots)
        assert inside <= b.size and (inside <= bucket or len(b.slots) == 1)
    assert all(l.partition_size == first.partition_size for l in layouts)
    for i, n in enumerate(numels):
        covered = []
        for layout in layouts:
            piece = layout.local_piece(i)
            if piece is not None:
                covered.append((piece[1], piece[1] + piece[2]))
        covered.sort()
        assert covered[0][0] == 0 and covered[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:])), covered


def test_parameters_are_laid_out_in_reverse():
    layout = FlatLayout([4, 4, 4], 8, 1, 0)
    assert layout.slots[2].offset < layout.slots[1].offset < layout.slots[0].offset
    assert layout.slots[2].bucket == 0 and layout.slots[0].bucket == 1
