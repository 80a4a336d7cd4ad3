"""Flat-buffer layout of every ZeRO stage: pure arithmetic.

Parameters are laid end to end in one flat buffer, grouped into buckets. Stages 0-2 (and stage 3's
persistent parameters) cut buckets by size, ending at parameter boundaries (a parameter larger than
the bucket size gets a bucket of its own); stage 3 makes one bucket per unit (a module's own
parameters, `FlatLayout.of_groups`). Each bucket is padded
to a multiple of the shard count n (times an alignment) and split into n equal chunks; rank r owns
chunk r of every bucket. A bucket is therefore exactly one reduce-scatter (or all-gather) over the
shard group, with no copies, and a rank's partition is the concatenation of its chunks (Megatron's distributed optimizer uses the
same per-bucket sharding). Gradients arrive roughly in reverse definition order, so parameters are
laid out in reverse: the first bucket fills first.

Nothing here touches tensors; `FlatLayout` is testable with plain numbers.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

# Every rank's chunk of a bucket is a multiple of this many elements, so each chunk starts 32-byte
# aligned for fp32 (16 for bf16): what collectives and vectorised optimizer loops like.
CHUNK_ALIGN = 8


class Piece(NamedTuple):
    """The part of one parameter in this rank's partition."""

    partition_offset: int  # where it starts in the partition
    param_offset: int  # where it starts inside the parameter's flat value
    length: int


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where one parameter lives: flat offset, size, bucket."""

    index: int  # position in the list of parameters given to the layout
    offset: int
    numel: int
    bucket: int


@dataclasses.dataclass(frozen=True)
class Bucket:
    index: int
    start: int  # flat offset of the bucket
    size: int  # padded size, a multiple of the shard count
    chunk: int  # size // shards
    local_offset: int  # where this rank's chunk of the bucket sits in its partition
    slots: tuple[int, ...]  # indices of the parameters inside

    def chunk_range(self, rank: int) -> tuple[int, int]:
        lo = self.start + rank * self.chunk
        return lo, lo + self.chunk


class FlatLayout:
    def __init__(
        self,
        numels: list[int],
        bucket_size: int,
        shards: int,
        rank: int,
        groups: list[list[int]] | None = None,
        param_align: int = 1,
    ):
        """Buckets of at most `bucket_size` elements in reverse parameter order, or exactly the
        given `groups` of parameter indices (in that order) when they are given. Each parameter
        starts at a multiple of `param_align` elements (zero padding between parameters)."""
        if bucket_size <= 0:
            raise ValueError(f"bucket size must be positive, got {bucket_size}")
        self.shards, self.rank = shards, rank
        if groups is None:
            groups = []
            filled = 0
            for i in reversed(range(len(numels))):
                if not groups or (filled + numels[i] > bucket_size and filled > 0):
                    groups.append([])
                    filled = 0
                groups[-1].append(i)
                filled += numels[i]

        slots: dict[int, Slot] = {}
        buckets: list[Bucket] = []
        offset = local = 0
        for b, members in enumerate(groups):
            start = offset
            for i in members:
                offset = -(-offset // param_align) * param_align
                slots[i] = Slot(i, offset, numels[i], b)
                offset += numels[i]
            used = offset - start
            unit = shards * CHUNK_ALIGN
            size = max(unit, -(-used // unit) * unit)
            buckets.append(Bucket(b, start, size, size // shards, local, tuple(members)))
            offset = start + size
            local += size // shards
        self.slots = [slots[i] for i in range(len(numels))]
        self.buckets = buckets
        self.total = offset  # padded flat size
        self.partition_size = local  # elements this rank owns (same on every rank)
        self.numel = sum(numels)  # unpadded

    @classmethod
    def of_groups(cls, group_numels: list[list[int]], shards: int, rank: int) -> "FlatLayout":
        """One bucket per group, parameters numbered consecutively across groups in order."""
        numels = [n for group in group_numels for n in group]
        groups, first = [], 0
        for group in group_numels:
            groups.append(list(range(first, first + len(group))))
            first += len(group)
        return cls(numels, 1, shards, rank, groups)

    def local_piece(self, index: int) -> Piece | None:
        """The part of parameter `index` in this rank's partition, or None if this rank owns none of it."""
        slot = self.slots[index]
        bucket = self.buckets[slot.bucket]
        lo, hi = bucket.chunk_range(self.rank)
        start, end = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
        if start >= end:
            return None
        return Piece(bucket.local_offset + (start - lo), start - slot.offset, end - start)
