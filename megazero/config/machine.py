"""The machine the flags are read for (`Machine`): the job's ranks, the ranks on this node, and
whether this machine has CUDA, which picks the default backend and decides a few checks (fused
attention, --compile). megazero.config.train_flags reads the flags against it; the launch (or the
dry run, which reads them as on a GPU machine) says what it is.

Owns these facts only; the checks of a config against the machine's memory and files are
megazero.config.machine_checks'. Loads no torch unless asked whether CUDA is there.
"""

from __future__ import annotations

from megazero.core.records import Record


class Machine(Record):
    """What the flags are read against (besides themselves)."""

    world_size: int = 1
    """Ranks in the job."""
    local_world_size: int = 0
    """Ranks on this node; 0: not known (--ranks-per-node says, else the whole world is one node)."""
    cuda_available: bool = False
    """Whether this machine has CUDA: NCCL is the default backend, the run's device a GPU."""

    @classmethod
    def of(cls, world_size: int = 1, local_world_size: int = 0, cuda_available: bool | None = None) -> "Machine":
        """This machine; `cuda_available` None: torch.cuda says (importing torch)."""
        cuda = torch_cuda_available() if cuda_available is None else cuda_available
        return cls(world_size=world_size, local_world_size=local_world_size, cuda_available=cuda)

    def backend(self, flag: str | None) -> str:
        """--distributed-backend, else nccl with CUDA and gloo without."""
        return flag or ("nccl" if self.cuda_available else "gloo")

    def uses_cuda(self, flag: str | None) -> bool:
        """Whether the run's device will be a GPU (the launch's rule: gloo runs on CPU)."""
        return self.backend(flag) == "nccl"


def torch_cuda_available() -> bool:
    import torch  # here, not at the top: the flags are checked before torch loads

    return torch.cuda.is_available()
