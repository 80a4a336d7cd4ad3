"""The processes a user's model trains on: torch.distributed as DeepSpeed's `init_distributed` starts
it (from the launcher's RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT), the device of this rank, and
megazero's process groups over them. Every rank is one data-parallel rank (a user's model has no
tensor or pipeline split here), cut into MiCS shard groups and hpZ blocks as the ZeRO config says.

Owns nothing global: the groups built are returned to the engine that uses them.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from megazero.core.errors import UsageError
from megazero.parallel.process_groups import GroupFactory, ProcessGroups
from megazero.parallel.topology import Topology
from megazero.zero.config import ZeroConfig


def init_distributed(dist_backend: str | None = None, timeout=datetime.timedelta(minutes=30), **_) -> None:
    """DeepSpeed's `init_distributed`: joins the launcher's process group if there is one (torchrun,
    the deepspeed launcher and Slurm's srun with the env variables set); one process runs alone."""
    if dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(local_rank())
    dist.init_process_group(backend, timeout=timeout)


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def rank_device() -> torch.device:
    """This rank's device: its GPU under an NCCL group (or any CUDA machine), else the CPU."""
    if dist.is_initialized() and str(dist.get_backend()) != "nccl":
        return torch.device("cpu")
    return torch.device("cuda", local_rank()) if torch.cuda.is_available() else torch.device("cpu")


def world() -> tuple[int, int]:
    """(rank, world size) of this process (0, 1 without torch.distributed)."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def check_data_parallel(group, what: str) -> None:
    """A data-parallel group given by the user (zero.Init's, an mpu's) must be every rank: the model
    is not split otherwise here."""
    if group is None or not dist.is_initialized():
        return
    if dist.get_world_size(group) != dist.get_world_size():
        raise UsageError(
            f"{what} spans {dist.get_world_size(group)} of {dist.get_world_size()} ranks: "
            f"megazero.initialize trains a model whole on every rank (tensor and pipeline "
            f"splits are pretrain_gpt.py's); leave it out so every rank is data parallel"
        )


def check_mpu(mpu) -> None:
    if mpu is None:
        return
    for name in (
        "get_model_parallel_world_size",
        "get_tensor_model_parallel_world_size",
        "get_pipeline_model_parallel_world_size",
    ):
        size = getattr(mpu, name, lambda: 1)()
        if size != 1:
            raise UsageError(
                f"mpu.{name}() is {size}: megazero.initialize takes no model-parallel unit "
                f"(tensor and pipeline parallelism are pretrain_gpt.py's flags); pass mpu=None"
            )
    check_data_parallel(getattr(mpu, "get_data_parallel_group", lambda: None)(), "mpu's data-parallel group")


def build_groups(zero: ZeroConfig, device: torch.device, factory: GroupFactory | None = None) -> ProcessGroups:
    """Every rank data parallel; MiCS shard groups and hpZ blocks from `zero`. LOCAL_WORLD_SIZE (the
    launcher's) says how many consecutive ranks share a node. `factory` reuses communicators."""
    rank, size = world()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", str(size)))
    if size % per_node:
        per_node = size
    topology = Topology(
        world_size=size,
        mics_shard_size=zero.mics_shard_size,
        ranks_per_node=per_node,
        hpz_partition_size=zero.zero_hpz_partition_size if zero.stage == 3 else 1,
    )
    if size == 1:
        return ProcessGroups.single(device)
    return ProcessGroups.build(topology, rank, factory or GroupFactory(rank), device=device)
