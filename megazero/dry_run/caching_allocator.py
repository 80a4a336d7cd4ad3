"""A model of CUDA's caching allocator (c10/cuda/CUDACachingAllocator.cpp), for the dry run's
reserved memory: what the GPU's memory holds in segments beside the bytes tensors occupy.

The facts it follows (torch's defaults: no max_split_size, no expandable segments):
- every request is rounded up to a multiple of 512 bytes;
- requests up to 1 MiB are "small" and come from 2 MiB segments; larger ones from the large pool,
  whose new segments are 20 MiB for requests under 10 MiB, else the request rounded up to 2 MiB;
- a request takes the smallest free block of its pool that fits (ties: the earlier segment, the
  lower address); the block is split when what is left is at least 512 bytes (small pool) or more
  than 1 MiB (large pool), otherwise the request keeps the whole block;
- a freed block merges with its free neighbours in the same segment and stays cached: segments are
  never returned (no empty_cache), so reserved memory only grows.
Streams are one (a block freed on one stream is reused by another at once): the dry run runs every
stream's work in program order.
"""

from __future__ import annotations

import bisect

BLOCK = 512
SMALL_SIZE = 1 << 20  # the largest "small" request
SMALL_SEGMENT = 2 << 20
LARGE_SEGMENT = 20 << 20  # for large requests under MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20


def rounded(nbytes: int) -> int:
    return max(BLOCK, -(-nbytes // BLOCK) * BLOCK) if nbytes else 0


def segment_size(size: int) -> int:
    """The segment a request of `size` (rounded) bytes opens when no cached block fits."""
    if size <= SMALL_SIZE:
        return SMALL_SEGMENT
    if size < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return -(-size // ROUND_LARGE) * ROUND_LARGE


class _Block:
    __slots__ = ("segment", "offset", "size", "free", "prev", "next")

    def __init__(self, segment: int, offset: int, size: int):
        self.segment, self.offset, self.size = segment, offset, size
        self.free, self.prev, self.next = True, None, None


class CachingAllocator:
    """malloc(nbytes) -> a block, free(block); `reserved` (the segments' bytes) and its peak."""

    def __init__(self):
        self.pools: dict[bool, list] = {True: [], False: []}  # small? -> sorted (size, segment, offset)
        self._cached: dict[tuple, _Block] = {}  # (segment, offset) -> a free block
        self._small_segments: set[int] = set()
        self.segments = 0
        self.reserved = 0
        self.peak_reserved = 0

    def malloc(self, nbytes: int) -> _Block:
        size = rounded(nbytes)
        small = size <= SMALL_SIZE
        pool = self.pools[small]
        i = bisect.bisect_left(pool, (size, -1, -1))
        if i < len(pool):
            _, segment, offset = pool.pop(i)
            block = self._cached.pop((segment, offset))
        else:
            block = _Block(self.segments, 0, segment_size(size))
            if small:
                self._small_segments.add(block.segment)
            self.segments += 1
            self.reserved += block.size
            self.peak_reserved = max(self.peak_reserved, self.reserved)
        left = block.size - size
        if (left >= BLOCK) if small else (left > SMALL_SIZE):
            rest = _Block(block.segment, block.offset + size, left)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            self._cache(rest, small)
        block.free = False
        return block

    def free(self, block: _Block) -> None:
        small = block.segment in self._small_segments
        block.free = True
        before, after = block.prev, block.next
        if after is not None and after.free:
            self._uncache(after, small)
            self._absorb(block, after)
        if before is not None and before.free:
            self._uncache(before, small)
            self._absorb(before, block)
            block = before
        self._cache(block, small)

    @staticmethod
    def _absorb(left: _Block, right: _Block) -> None:
        """`left` takes in its free neighbour `right` (the next block of its segment)."""
        left.size += right.size
        left.next = right.next
        if right.next is not None:
            right.next.prev = left

    def _cache(self, block: _Block, small: bool) -> None:
        bisect.insort(self.pools[small], (block.size, block.segment, block.offset))
        self._cached[(block.segment, block.offset)] = block

    def _uncache(self, block: _Block, small: bool) -> None:
        pool = self.pools[small]
        del pool[bisect.bisect_left(pool, (block.size, block.segment, block.offset))]
        del self._cached[(block.segment, block.offset)]


def replay(requests: list) -> dict:
    """The allocator's figures for a log of requests (device_stand_in's `requests`): an int n >= 0
    asks n bytes; a negative int -j frees the j-th newest live block (-1: the newest); a str notes a
    phase, whose reserved bytes at that point are kept (the last note of each phase). Returns
    {"reserved_peak", "segments", "reserved_at": {phase: bytes}}."""
    allocator, live, at = CachingAllocator(), [], {}
    for r in requests:
        if type(r) is str:
            at[r] = allocator.reserved
        elif r >= 0:
            live.append(allocator.malloc(r))
        else:
            allocator.free(live.pop(len(live) + r))
    return {"reserved_peak": allocator.peak_reserved, "segments": allocator.segments, "reserved_at": at}
