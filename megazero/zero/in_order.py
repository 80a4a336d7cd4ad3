"""Gradient reductions in one order on every rank, for models whose parameters may get no gradient
on some ranks (an expert of a user's model that got no tokens there): megazero.initialize's engine
at stages 0-2 (ZeroEngine's `uneven_gradients`).

The flat groups share their data-parallel communicator, and a collective must be issued in the same
order on every rank. A bucket is full when all its gradients came; where one never comes on a rank,
that rank's buckets would fill in another order than elsewhere. So every bucket of every flat group
gets a place in one sequence, fixed at build time (by its latest-registered parameter, latest first:
autograd produces gradients roughly in reverse registration order), and a full bucket is reduced
only when every bucket before it has been; at the backward's end the rest are reduced in sequence,
a bucket no gradient reached with zeros. On a rank where no gradient is missing the sequence only
waits where the arrival order differs from the estimate; a rank with an idle expert holds the
buckets after it until the end.

Owns the sequence; the buckets and their reductions are FlatParamGroup's.
"""

from __future__ import annotations


class InOrderReductions:
    def __init__(self, groups_and_params: list[tuple[object, list]], order: list):
        """`groups_and_params`: (FlatParamGroup, its parameters in the group's order, before the
        engine replaced them); `order`: every parameter in registration order."""
        position = {id(p): i for i, p in enumerate(order)}
        keyed = []
        for group, params in groups_and_params:
            latest: dict[int, int] = {}
            for i, p in enumerate(params):
                b = group.layout.slots[i].bucket
                latest[b] = max(latest.get(b, -1), position[id(p)])
            keyed += [(-latest.get(b, -1), len(keyed) + b, group, b) for b in range(len(group.layout.buckets))]
        self.groups = [group for group, _ in groups_and_params]
        self.sequence = [(group, b) for *_, group, b in sorted(keyed, key=lambda e: e[:2])]
        self.next, self.full = 0, set()

    def start(self) -> None:
        self.next, self.full = 0, set()

    def ready(self, group, b: int) -> None:
        """Bucket b of `group` is full: reduce it and every full one after it, up to the first that
        is not."""
        self.full.add((id(group), b))
        while (
            self.next < len(self.sequence)
            and (id(self.sequence[self.next][0]), self.sequence[self.next][1]) in self.full
        ):
            group, b = self.sequence[self.next]
            group.reduce_in_turn(b)
            self.next += 1

    def flush(self) -> None:
        """The backward's end: the buckets not reduced yet, in sequence (zeros where nothing came)."""
        for group, b in self.sequence[self.next :]:
            group.reduce_in_turn(b)
        self.next = len(self.sequence)
        for group in self.groups:
            group.end_in_order()
