"""The flat bucket layout as plain arithmetic: buckets end at parameter boundaries, chunks are equal
and aligned, and the ranks' local pieces tile every parameter exactly once."""

import pytest

from megazero.zero.flat import CHUNK_ALIGN, FlatLayout


@pytest.mark.parametrize(
    "numels,bucket,shards",
    [
        ([10, 3, 7, 100, 1], 16, 4),
        ([5], 1000, 3),
        ([64, 64, 64], 64, 2),
        ([1, 1, 1, 1, 1], 2, 8),
    ],
)
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


def test_parameter_alignment_pads_between_parameters():
    numels = [10, 3, 7, 100, 1]
    plain, aligned = FlatLayout(numels, 16, 4, 0), FlatLayout(numels, 16, 4, 0, param_align=8)
    assert [b.slots for b in plain.buckets] == [b.slots for b in aligned.buckets]  # same buckets
    assert all(s.offset % 8 == 0 for s in aligned.slots)
    assert any(s.offset % 8 for s in plain.slots)
    for i, n in enumerate(numels):  # the pieces still tile every parameter
        pieces = [FlatLayout(numels, 16, 4, r, param_align=8).local_piece(i) for r in range(4)]
        assert sum(p.length for p in pieces if p is not None) == n


def test_parameter_alignment_aligns_every_weight_and_changes_nothing_else():
    """zero_optimization.parameter_alignment (stages 1-2): every parameter view starts 16-byte
    aligned in the flat buffer (bf16: 8 elements); in fp32 the run is the same run."""
    from tests.layouts import run_training, small_config, with_padded_vocab
    from megazero.parallel.process_groups import ProcessGroups
    from megazero.training import setup

    odd = {"hidden_size": 36}  # 36-element norms: the next parameter starts unaligned
    for stage in (1, 2):
        cfg = with_padded_vocab(
            small_config(stage=stage, layers=2, bf16=True, model_extra=odd, zero_extra={"parameter_alignment": True})
        )
        params = list(setup(cfg, ProcessGroups.single()).engine.parameters())
        assert all(p.data_ptr() % 16 == 0 for p in params)
    cfg = with_padded_vocab(small_config(stage=1, layers=2, bf16=True, model_extra=odd))
    assert any(p.data_ptr() % 16 for p in setup(cfg, ProcessGroups.single()).engine.parameters())
    plain = run_training(small_config(stage=2, layers=2, steps=3, model_extra=odd), ProcessGroups.single())
    aligned = run_training(
        small_config(stage=2, layers=2, steps=3, model_extra=odd, zero_extra={"parameter_alignment": True}),
        ProcessGroups.single(),
    )
    assert aligned["losses"] == pytest.approx(plain["losses"], rel=1e-6)
