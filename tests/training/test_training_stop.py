"""--exit-duration-in-mins and --exit-signal-handler: the per-step agreement on stopping rides in the
step's loss reduction (megazero.training._global_loss) instead of two reductions of its own.

- Decisions: at TP 2 x PP 2 and DP 2 x PP 2, with a signal seen on one rank only (step 2) and the
  clock past the limit on another rank only (step 3), the flags every rank gets back from the step
  equal the old check's (one agree_on_failure reduction per condition), step by step; `train()`
  stops every rank after the same iteration.
- The losses are bitwise those of a run without the options (the loss enters the new reduction
  once; planted: adding it on every TP rank doubles it at TP 2).
- Cost: per step and rank, the options add no host sync and at most one collective (a pipeline
  stage other than the last now joins the DP reduction); the old check added four all-reduces and
  two .item() calls.
"""

import torch

from tests.layouts import setup_training, small_config, with_padded_vocab
from megazero.checkpoint.policy import SavePolicy
from megazero.checkpoint.saver import agree_on_failure
from megazero.core import comm
from megazero.parallel.topology import Topology
from megazero.training import train, train_step

LAYOUTS = [("tp 2 x pp 2", dict(tp=2, pp=2)), ("dp 2 x pp 2", dict(pp=2))]
STEPS = 3


class Counts:
    """Calls to the comm layer's reductions and to the host-syncing tensor reads, while installed."""

    NAMES = ("all_reduce", "broadcast")

    def __init__(self):
        self.collectives = self.syncs = 0
        self._saved = {}

    def __enter__(self):
        for name in self.NAMES:
            self._saved[(comm, name)] = original = getattr(comm, name)
            setattr(comm, name, self._counting(original, "collectives"))
        for name in ("item", "tolist"):
            self._saved[(torch.Tensor, name)] = original = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._counting(original, "syncs"))
        return self

    def _counting(self, fn, field):
        def wrapped(*args, **kwargs):
            setattr(self, field, getattr(self, field) + 1)
            return fn(*args, **kwargs)

        return wrapped

    def __exit__(self, *exc):
        for (owner, name), original in self._saved.items():
            setattr(owner, name, original)


def stop_worker(ctx, topology):
    groups = ctx.groups(Topology(world_size=4, **topology))
    cfg = with_padded_vocab(small_config(steps=STEPS, global_batch=8, **topology))
    plain_state, plain_source = setup_training(cfg, groups)
    state, source = setup_training(cfg, groups)
    policy = SavePolicy(exit_duration_mins=30.0)
    steps = []
    for it in range(STEPS):
        with Counts() as plain:
            plain_loss = train_step(plain_state, plain_source.batch(it), 1e-3).loss
        if it == 1 and ctx.rank == 3:
            policy.signalled = True  # as the SIGTERM handler does, on one rank
        if it == 2 and ctx.rank == 1:
            policy.started -= 3600  # this rank's clock is past the limit
        with Counts() as flagged:
            step = train_step(state, source.batch(it), 1e-3, policy.stop_flags)
        late, signalled = policy.stop_flags()
        old = (agree_on_failure(late, groups), agree_on_failure(signalled, groups))
        steps.append(
            dict(
                agreed=step.stop_flags,
                old=old,
                loss=step.loss,
                plain_loss=plain_loss,
                extra_collectives=flagged.collectives - plain.collectives,
                extra_syncs=flagged.syncs - plain.syncs,
            )
        )
    # train() itself: one rank signalled before the first step; every rank stops after it.
    state, source = setup_training(cfg, groups)
    signalled = SavePolicy(exit_duration_mins=30.0)
    signalled.signalled = ctx.rank == 2
    history = train(state, source, None, lambda it, _samples: 1e-3, policy=signalled)
    return steps, [record["iteration"] for record in history]


def test_stop_flags_ride_in_the_loss_reduction(dist_pool):
    pool = dist_pool(4)
    for name, topology in LAYOUTS:
        per_rank = pool.run(stop_worker, topology)
        for rank, (steps, iterations) in enumerate(per_rank):
            assert [s["agreed"] for s in steps] == [s["old"] for s in steps], f"{name} rank {rank}"
            assert [s["agreed"] for s in steps] == [(False, False), (False, True), (True, True)], name
            assert all(s["loss"] == s["plain_loss"] for s in steps), f"{name} rank {rank}: losses differ"
            assert all(s["extra_syncs"] == 0 for s in steps), f"{name} rank {rank}: {steps}"
            assert all(s["extra_collectives"] <= 1 for s in steps), f"{name} rank {rank}: {steps}"
            assert iterations == [1], f"{name} rank {rank}: train() ran iterations {iterations}"
