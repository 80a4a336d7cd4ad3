"""Megatron-LM's --rampup-batch-size START INCREMENT SAMPLES: the global batch grows from START by
INCREMENT until SAMPLES samples are consumed, then stays at --global-batch-size. Pure arithmetic,
read by the edge (iterations of a --train-samples run) and the loop (each step's batch).

Megatron's rule (its RampupBatchsizeNumMicroBatchesCalculator and update_train_iters): before each
step, with `consumed` samples consumed so far, the batch is the full global batch once consumed >
SAMPLES, else START + int(consumed / (SAMPLES / increments)) x INCREMENT, increments = (global -
START) / INCREMENT. Step i draws the samples [consumed(i), consumed(i) + batch(i)) in order, so a
run resumed at any iteration draws exactly the samples it would have drawn.
"""

from __future__ import annotations

from pydantic import ConfigDict

from megazero.core.records import Record


class BatchRamp(Record):
    model_config = ConfigDict(frozen=True)
    start: int
    increment: int
    samples: int
    global_batch: int

    @property
    def samples_per_increment(self) -> float:
        return self.samples / ((self.global_batch - self.start) // self.increment)

    def batch_at_consumed(self, consumed: int) -> int:
        """The global batch of the step taken after `consumed` samples."""
        if consumed > self.samples:
            return self.global_batch
        return self.start + int(consumed / self.samples_per_increment) * self.increment

    def batch_sizes(self, iterations: int) -> list[int]:
        """The global batch of each of the first `iterations` steps."""
        out, consumed = [], 0
        for _ in range(iterations):
            out.append(self.batch_at_consumed(consumed))
            consumed += out[-1]
        return out

    def consumed_before(self, iteration: int) -> int:
        """Samples consumed by the steps before step `iteration` (counting from 0)."""
        consumed, it = 0, 0
        while it < iteration and consumed <= self.samples:
            consumed += self.batch_at_consumed(consumed)
            it += 1
        return consumed + (iteration - it) * self.global_batch

    def train_iters(self, train_samples: int) -> int:
        """Megatron's iteration count for --train-samples: the ramp's steps, counted while the
        consumed samples are within the ramp and the run, then whole global batches (the last
        partial batch is dropped)."""
        iterations = consumed = 0
        while consumed <= self.samples and consumed <= train_samples:
            consumed += self.batch_at_consumed(consumed)
            iterations += 1
        if train_samples > consumed:
            iterations += (train_samples - consumed) // self.global_batch
        return iterations
