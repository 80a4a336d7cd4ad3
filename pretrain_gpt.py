"""Pretrain a GPT with tensor x pipeline x ZeRO data parallelism.

    python pretrain_gpt.py                                   # small GPT on the embedded corpus, 1 CPU
    torchrun --nproc-per-node 4 pretrain_gpt.py --tensor-model-parallel-size 2 --zero-stage 3

Flags follow Megatron-LM's names (see --help). A run goes: flags -> config -> checks against the
machine and files -> process groups -> data -> model chunks -> ZeRO engine -> training loop.

Where to read next (docs/design.md draws the whole map):
  megazero/run/launch.py         the driver: rendezvous, one agreed error line, the order above
  megazero/training/loop.py       a training step: microbatches through the pipeline schedule, then ZeRO's step
  megazero/zero/engine.py    the ZeRO engine: stages 0-3 behind one interface
  megazero/zero/storage.py   the partitioned storage every stage keeps its parameters and states in
"""

import sys

from megazero.run.launch import main

if __name__ == "__main__":
    sys.exit(main())
