"""Which samples each data-parallel rank trains on: Megatron's pretraining sampler, as microbatches.

Owns the order only (a pure function of the step, the rank and the batch sizes), so every layout
and every restart draws the same samples for the same step; the samples themselves come from any
indexable dataset of token arrays (megazero.data's GPT datasets, mock data).
"""

from __future__ import annotations

import torch


class MicrobatchSource:
    """This DP rank's microbatches of global batch `i` from an indexable dataset of token arrays.

    Global batch i is samples [i*G, (i+1)*G); microbatch j of DP rank r takes mbs consecutive
    samples starting at i*G + j*mbs*dp + r*mbs (Megatron's pretraining sampler order). With a
    `ramp` (--rampup-batch-size) batch i starts after the samples the steps before it consumed and
    is as large as the ramp says."""

    def __init__(self, dataset, global_batch: int, micro_batch: int, dp_rank: int, dp_size: int, ramp=None):
        self.dataset, self.global_batch, self.micro_batch = dataset, global_batch, micro_batch
        self.dp_rank, self.dp_size, self.ramp = dp_rank, dp_size, ramp
        self.num_microbatches = global_batch // (micro_batch * dp_size)

    def batch(self, i: int) -> list[torch.Tensor]:
        base, size = i * self.global_batch, self.global_batch
        if self.ramp is not None:
            base = self.ramp.consumed_before(i)
            size = self.ramp.batch_at_consumed(base)
        out = []
        for j in range(size // (self.micro_batch * self.dp_size)):
            start = base + j * self.micro_batch * self.dp_size + self.dp_rank * self.micro_batch
            rows = [
                torch.as_tensor(self.dataset[start + k]["tokens"], dtype=torch.long) for k in range(self.micro_batch)
            ]
            out.append(torch.stack(rows))
        return out
