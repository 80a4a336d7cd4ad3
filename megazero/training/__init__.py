"""The runtime of a training run, from a checked TrainConfig and process groups on: nothing here reads
a flag, the environment or argv.

    assembly.py       TrainState: model chunks + ZeRO engine + p2p + streams, built by `setup`
    model_builder.py  this rank's model chunks: the pure GPT on meta, TP / CP / EP / PP applied, init_fn
    loop.py           a step (`train_step`: microbatches through the pipeline schedule, then the
                      optimizer step), evaluation and the loop (`train`)
    lr_schedule.py    Megatron's learning-rate rules
    metrics.py        a step's record, the log line and metrics.jsonl; monitor.py: wandb and TensorBoard behind it
    flops.py          model FLOPs, MFU and HFU
    moe_stats.py      a step's mixture-of-experts bookkeeping summed over the layout
    stragglers.py     per-rank phase times at each log line; the slow rank named
    housekeeping.py   --manual-gc and --profile around a step
    out_of_memory.py  the line of an allocation that failed mid-step

`setup`, `train_step`, `train` and `TrainState` are the room's face, imported from here.
"""

from megazero.training.assembly import TrainState, setup
from megazero.training.loop import train, train_step

__all__ = ["TrainState", "setup", "train", "train_step"]
