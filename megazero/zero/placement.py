"""Where the optimizer's states live and what runs around the step: one strategy object the engine
holds (`optimizer_placement`), so the engine itself has no branch for any of them.

The strategies (the first two in offload.py):
- `OnDevice`: the fp32 master and the Adam moments stay in the storages, on the device.
- `Offloaded` (`offload_optimizer`): they move to host memory or to nvme swap files (one folder per
  rank under nvme_path/megazero_swap/rank{r}/optimizer), and the CPU Adam steps them.
- ZenFlow (`zero_optimization.zenflow`, megazero.zero.zenflow.strategy): offloaded, with the
  important columns stepped on the device every step and the rest by the CPU Adam once per window.

Each strategy: `place(storage, name)` once the storage holds its values; `before_step(storages,
step, coef)` once per step, before the storages step; `checkpoint_index(storages, name_of)` the
entries it adds to this rank's checkpoint index, and `restore(indexes, storages, name_of)` reads
them back (megazero.checkpoint calls both and knows no strategy).
"""

from __future__ import annotations

from .config import ZeroConfig
from .offload import Offloaded, OnDevice
from .zenflow.strategy import ZenFlow
from .zero_groups import ZeroGroups


def optimizer_placement(zero: ZeroConfig, groups: ZeroGroups, counts_in_norm) -> OnDevice:
    """The strategy the settings ask for. `counts_in_norm(param)`: the gradient norm's rule of which
    rank counts a replicated parameter (ZenFlow's "auto" counts each matrix once by it)."""
    if not zero.offloads_optimizer:
        return OnDevice()
    if zero.zenflow is not None:
        return ZenFlow(zero, groups, counts_in_norm)
    return Offloaded(zero, groups)
