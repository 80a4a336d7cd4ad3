"""`zero.Init`: build a model too large for one rank, its parameters sharded from the start.

    with megazero.zero.Init():               # DeepSpeed's deepspeed.zero.Init, same arguments
        model = LlamaForCausalLM(config)     # no rank ever holds the whole model
    engine, *_ = megazero.initialize(model=model, config="ds.json")

Inside the context every parameter a module registers lives on the meta device; its initialisation
(the module's reset_parameters, a Hugging Face model's _init_weights, anything else) is recorded
and, when the context closes, replayed one parameter at a time with the random draws the eager build
takes (init_replay.py): the values equal those of the same model built outside, seed for seed. Of
each final value this rank keeps its slice (a contiguous 1/N of the flattened parameter, N the
data-parallel ranks) in the parameter's `init_shard`; the parameter itself stays a meta tensor of its
full shape. `megazero.initialize` builds the engine's storage over those parameters and fills it
from the slices (`adopt_initial_values`: one all-gather of one parameter at a time). Before that,
`GatheredParameters` gathers and re-slices them (stage3/gathered.py).

A config given whose stage is below 3 is refused: DeepSpeed partitions the parameters anyway and its
stage 1/2 engine then fails at the first forward ("mat2 must be a matrix"). Owns the context, the
slices and their adoption; the recording and replay are init_replay.py's.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from megazero.core import comm
from megazero.core.errors import UsageError
from megazero.models.param_info import param_info, set_param_info
from .init_replay import Recorder, replay


@dataclasses.dataclass
class InitShard:
    """This rank's slice of a parameter built by zero.Init: elements [rank * chunk, ...) of its
    flattened value (the last rank's may be shorter, or empty)."""

    values: torch.Tensor
    shape: tuple
    dtype: torch.dtype
    group: comm.Group

    @property
    def chunk(self) -> int:
        numel = int(torch.Size(self.shape).numel())
        return -(-numel // self.group.size)

    def full(self) -> torch.Tensor:
        """The whole value, gathered from every rank's slice (collective over the group)."""
        numel = int(torch.Size(self.shape).numel())
        piece = torch.zeros(self.chunk, dtype=self.dtype, device=self.group.device)
        piece[: self.values.numel()].copy_(self.values)
        whole = torch.empty(self.chunk * self.group.size, dtype=self.dtype, device=self.group.device)
        comm.all_gather(whole, piece, self.group)
        return whole[:numel].view(self.shape)

    def reslice(self, full: torch.Tensor) -> None:
        """Keeps this rank's slice of `full` (the same on every rank)."""
        start = min(self.group.rank * self.chunk, full.numel())
        end = min(start + self.chunk, full.numel())
        self.values = full.detach().reshape(-1)[start:end].to(self.group.device, self.dtype).clone()


class Init:
    """DeepSpeed's zero.Init arguments. `data_parallel_group` (or `mpu`'s) must be every rank;
    `remote_device` and `pin_memory` are accepted (the slices live in this rank's memory until the
    engine places them as its config says); `dtype` casts the parameters; `module` partitions a model
    already built instead of the construction inside the context."""

    def __init__(
        self,
        module: nn.Module | None = None,
        data_parallel_group=None,
        mem_efficient_linear=True,
        remote_device=None,
        pin_memory=False,
        config_dict_or_path=None,
        config=None,
        enabled=True,
        dtype=None,
        mpu=None,
        **unsupported,
    ):
        if unsupported:
            raise UsageError(f"zero.Init: {', '.join(sorted(unsupported))} is not supported; remove it")
        self.enabled = enabled
        self.dtype = dtype
        _check_stage(config_dict_or_path if config_dict_or_path is not None else config)
        if mpu is not None and data_parallel_group is None:
            data_parallel_group = mpu.get_data_parallel_group()
        self.group = _group(data_parallel_group) if enabled else None
        self.recorder: Recorder | None = None
        self.params: list[nn.Parameter] = []
        self._hook = None
        if module is not None and enabled:
            self.shard_module(module)

    # --- the context --------------------------------------------------------------------------
    def __enter__(self):
        if not self.enabled or _active():
            self.enabled = False  # nested: the outer context records
            return self
        self.recorder = Recorder()
        self.recorder.__enter__()
        self._hook = nn.modules.module.register_module_parameter_registration_hook(self._registered)
        _ACTIVE.append(self)
        return self

    def __exit__(self, kind, err, tb):
        if not self.enabled:
            return False
        _ACTIVE.remove(self)
        self._hook.remove()
        self.recorder.__exit__(kind, err, tb)
        if kind is None:
            replay(self.recorder.log, self.params, self._keep)
        self.recorder = None
        return False

    def _registered(self, module, name, param):
        """A parameter registered inside the context: swapped for a meta one (see the docstring)."""
        if param is None or param.is_meta:
            if param is not None and all(p is not param for p in self.params):
                self.params.append(param)
            return None
        meta = nn.Parameter(
            torch.empty(param.shape, dtype=param.dtype, device="meta"), requires_grad=param.requires_grad
        )
        self.recorder.initial_value(meta, param.detach())
        self.params.append(meta)
        return meta

    def _keep(self, param: torch.Tensor, value: torch.Tensor) -> None:
        dtype = self.dtype or value.dtype
        shard = InitShard(torch.empty(0), tuple(value.shape), dtype, self.group)
        shard.reslice(value)
        if dtype != param.dtype:
            param.data = torch.empty(param.shape, dtype=dtype, device="meta")
        set_param_info(param, init_shard=shard)

    def shard_module(self, module: nn.Module) -> None:
        """Partitions a model built already: each parameter's slice kept, the parameter made meta."""
        for p in {id(p): p for p in module.parameters()}.values():
            if p.is_meta:
                raise UsageError(
                    "zero.Init(module=...): the model has parameters on the meta device; build "
                    "it with values, or inside `with zero.Init():`"
                )
            value = p.detach()
            p.data = torch.empty(p.shape, dtype=self.dtype or p.dtype, device="meta")
            self._keep(p, value)


_ACTIVE: list[Init] = []  # the open contexts: a nested one leaves the recording to the outer


def _active() -> bool:
    return bool(_ACTIVE)


def _group(torch_group) -> comm.Group:
    """The data-parallel ranks the slices are cut over: every rank (megazero.initialize trains the
    model whole on each), on the device its collectives use."""
    if not dist.is_initialized():
        return comm.Group("zero.Init", (0,), 0, None, True, comm.CommLog())
    if torch_group is not None and dist.get_world_size(torch_group) != dist.get_world_size():
        raise UsageError(
            f"zero.Init: data_parallel_group spans {dist.get_world_size(torch_group)} of "
            f"{dist.get_world_size()} ranks; megazero trains a user's model data parallel over "
            f"every rank: leave it out"
        )
    nccl = str(dist.get_backend()) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    ranks = tuple(range(dist.get_world_size()))
    return comm.Group("zero.Init", ranks, dist.get_rank(), dist.group.WORLD, True, comm.CommLog(), device)


def _check_stage(config) -> None:
    if config is None:
        return
    data = config if isinstance(config, dict) else json.loads(Path(config).read_text())
    block = data.get("zero_optimization", data if "stage" in data else {})
    stage = block.get("stage", 0) if isinstance(block, dict) else 0
    if stage != 3:
        raise UsageError(
            f"zero.Init with zero_optimization.stage {stage}: only stage 3 keeps parameters "
            f"partitioned (DeepSpeed partitions them anyway and its stage-{stage} engine fails at "
            f"the first forward); set stage 3, or pass enabled=False to build the model whole"
        )


def built_by_init(model: nn.Module) -> bool:
    return any(param_info(p).init_shard is not None for p in model.parameters())


def adopt_initial_values(model: nn.Module, engine) -> None:
    """Fills the engine's storage (built with zeros) from the parameters' zero.Init slices: one
    parameter gathered at a time, in the model's order on every rank; the slices are let go."""
    for p in {id(p): p for p in model.parameters()}.values():
        info = param_info(p)
        if info.init_shard is None:
            continue
        shard = info.init_shard
        full = shard.full().to(engine.device, torch.float32)
        info.zero_storage.write_full(p, "fp32", full)
        del full
        # The engine's parameter took the record of the zero.Init one, slice included, and that one
        # lives on wherever the user's code keeps it: the slice's memory goes here, not with either.
        shard.values = shard.values.new_empty(0)
        set_param_info(p, init_shard=None)
