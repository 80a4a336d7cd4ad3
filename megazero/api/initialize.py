"""`megazero.initialize`: DeepSpeed's `deepspeed.initialize` for any nn.Module, on megazero's ZeRO.

    engine, optimizer, dataloader, lr_scheduler = megazero.initialize(model=model, config="ds.json")

In order: the config is read and checked (megazero.config.deepspeed_json: every key mapped or
refused, one line each) and the model is checked (its parameters on the CPU or this rank's device,
or built by megazero.zero.Init; not wrapped already) before any process group or tensor is made;
then torch.distributed is joined (init_distributed), the groups are built, and the model's
parameters are handed to megazero's ZeroEngine (the same engine pretrain_gpt.py trains with), which
replaces them by its own, sharded as the config's stage says. A model built under zero.Init is
adopted shard by shard (zero/init.py), never whole.

Owns the wiring only: the settings (settings.py), the optimizer and its groups (optimizer.py), the
schedulers (schedulers.py), the model's checks (modules.py) and the engine API (engine.py) are apart.
"""

from __future__ import annotations

import os

import torch

from megazero.core.errors import UsageError
from megazero.zero.engine import ZeroEngine
from megazero.zero.init import adopt_initial_values, built_by_init
from megazero.zero.stage3.gathered import register_external_parameter
from megazero.zero.zero_groups import ZeroGroups
from megazero.models.param_info import param_info
from .engine import Engine
from .groups import build_groups, check_mpu, init_distributed, rank_device
from .modules import check_model, leaf_config, move_buffers
from .optimizer import GroupSpec, ZeroOptimizer, from_client_optimizer, groups_from_parameters, muon_matrix
from .schedulers import scheduler_from_config
from .settings import ApiSettings, api_settings


def initialize(
    args=None,
    model=None,
    optimizer=None,
    model_parameters=None,
    training_data=None,
    lr_scheduler=None,
    distributed_port=None,
    mpu=None,
    dist_init_required=None,
    collate_fn=None,
    config=None,
    mesh_param=None,
    config_params=None,
    *,
    process_groups=None,
):
    """DeepSpeed's arguments and return value: (engine, optimizer, dataloader or None, lr_scheduler
    or None). `config`: a DeepSpeed JSON path or dict (or `args.deepspeed_config`, `config_params`).
    `process_groups` (megazero's own): groups already built for these ranks (their communicators are
    reused), e.g. by a test's pool."""
    config = _config_of(args, config, config_params)
    if model is None:
        raise UsageError("megazero.initialize needs model=<your nn.Module>")
    if mesh_param is not None:
        raise UsageError("mesh_param is not supported: every rank is data parallel here; leave it out")
    check_mpu(mpu)
    dp = process_groups.dp.size if process_groups is not None else _world_size_before_init()
    settings = api_settings(config, dp)
    check_model(model)
    adam, groups = _optimizer_groups(optimizer, model_parameters, model, settings)
    if dist_init_required is not False:
        init_distributed()
    device = rank_device()
    pgroups = process_groups or build_groups(settings.zero, device)
    if settings.seed is not None:
        torch.manual_seed(settings.seed)
    names = {id(p): n for n, p in model.named_parameters()}
    group_names = [[names[id(p)] for p in g.params] for g in groups]
    zero = _build_engine(model, settings, adam, groups, pgroups, device)
    zero_optimizer = ZeroOptimizer(_engine_groups(groups, group_names, zero), adam, zero, lr_source=optimizer)
    scheduler = _scheduler(lr_scheduler, settings, zero_optimizer, optimizer)
    engine = Engine(model, zero, zero_optimizer, scheduler, settings, pgroups, device)
    if pgroups.rank == 0:
        for note in settings.notes:
            print(f"megazero: note: {note}", flush=True)
    loader = _dataloader(training_data, settings, pgroups, collate_fn) if training_data is not None else None
    return engine, zero_optimizer, loader, scheduler


def _config_of(args, config, config_params):
    given = [c for c in (config, config_params, getattr(args, "deepspeed_config", None)) if c is not None]
    if not given:
        raise UsageError(
            'megazero.initialize needs a DeepSpeed config: config="ds.json" (or a dict), or '
            "args with --deepspeed_config (megazero.add_config_arguments)"
        )
    if len(given) > 1 and any(g is not given[0] and g != given[0] for g in given[1:]):
        raise UsageError(
            "the DeepSpeed config is given twice (config, config_params or args.deepspeed_config); give it once"
        )
    return given[0]


def _world_size_before_init() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


def _optimizer_groups(optimizer, model_parameters, model, settings: ApiSettings):
    """(AdamConfig, param groups): from the config's optimizer block or the user's optimizer."""
    if optimizer is not None and settings.adam is not None:
        raise UsageError(
            f"{settings.where} has an optimizer block and optimizer= is given too; give one "
            f"(DeepSpeed refuses both as well)"
        )
    if callable(optimizer) and not hasattr(optimizer, "param_groups"):
        raise UsageError(
            "optimizer= as a callable is not supported; pass torch.optim.AdamW(...) or an "
            '"optimizer" block in the config'
        )
    if optimizer is not None:
        adam, groups = from_client_optimizer(optimizer)
    elif settings.adam is not None:
        adam = settings.adam
        groups = groups_from_parameters(model_parameters, model, adam)
    else:
        raise UsageError(
            f"{settings.where} has no optimizer block and no optimizer= was given; add "
            f'"optimizer": {{"type": "AdamW", "params": {{"lr": 1e-4}}}}'
        )
    _check_groups_cover(groups, model)
    return adam, groups


def _check_groups_cover(groups: list[GroupSpec], model) -> None:
    """Every trainable parameter of the model is in exactly one group: ZeRO steps what it holds."""
    names = {id(p): n for n, p in model.named_parameters()}
    seen: dict[int, int] = {}
    for g, group in enumerate(groups):
        for p in group.params:
            if id(p) not in names:
                raise UsageError(
                    "the optimizer's (or model_parameters') parameters include one that is not "
                    "the model's; build the optimizer on model.parameters()"
                )
            if id(p) in seen:
                raise UsageError(f"parameter {names[id(p)]!r} is in two param groups; give it one")
            seen[id(p)] = g
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in seen]
    if missing:
        raise UsageError(
            f"{len(missing)} trainable parameters of the model are in no param group (e.g. "
            f"{missing[0]!r}): ZeRO steps every parameter it holds; add them, or set "
            f"requires_grad=False on those to freeze"
        )


def _build_engine(model, settings: ApiSettings, adam, groups: list[GroupSpec], pgroups, device) -> ZeroEngine:
    names = {id(p): n for n, p in model.named_parameters()}
    frozen = {names[id(p)] for p in model.parameters() if not p.requires_grad}
    group_of = {names[id(p)]: g for g, group in enumerate(groups) for p in group.params}
    decay = {n: (groups[g].weight_decay if n not in frozen else 0.0) for n, g in group_of.items()}
    by_init = built_by_init(model)
    zero_cfg = leaf_config(model, settings.zero)
    move_buffers(model, device)

    def init_fn(name, param):
        if by_init:  # values follow (adopt_initial_values); a zero of no size stands for the whole
            return torch.zeros(1, dtype=torch.float32).expand(param.numel())
        return param.detach().to("cpu", torch.float32)

    engine = ZeroEngine(
        [model],
        init_fn,
        groups=ZeroGroups.from_grid(pgroups),
        zero=zero_cfg,
        adam=adam,
        precision=settings.precision,
        clip_grad=settings.clip_grad,
        device=device,
        lr_group=(lambda name: group_of.get(name, 0)) if len(groups) > 1 else None,
        weight_decay_of=lambda name, shape: decay.get(name, 0.0),
        muon=settings.muon,
        muon_matrix=muon_matrix if settings.muon is not None else None,
        uneven_gradients=True,
    )
    if by_init:
        adopt_initial_values(model, engine)
    for param in engine.parameters():  # declared before the engine existed
        for module in param_info(param).external_users:
            register_external_parameter(module, param)
    return engine


def _engine_groups(groups: list[GroupSpec], group_names: list[list[str]], zero: ZeroEngine) -> list[GroupSpec]:
    """The param groups over the engine's parameters (each user parameter replaced by the engine's,
    found by its name)."""
    by_name = {zero.names[id(p)]: p for p in zero.parameters()}
    return [
        GroupSpec([by_name[n] for n in names if n in by_name], g.lr, g.weight_decay)
        for g, names in zip(groups, group_names)
    ]


def _scheduler(lr_scheduler, settings: ApiSettings, optimizer: ZeroOptimizer, client_optimizer):
    """The config's scheduler, or the user's: a callable optimizer -> scheduler (called with the
    returned optimizer), or a scheduler built on the optimizer the user passed (its rates are read
    from that optimizer at every step)."""
    if lr_scheduler is not None and settings.scheduler is not None:
        raise UsageError(f"{settings.where} has a scheduler block and lr_scheduler= is given too; give one")
    if lr_scheduler is None:
        return scheduler_from_config(settings.scheduler, optimizer)
    if hasattr(lr_scheduler, "step"):
        if client_optimizer is None or getattr(lr_scheduler, "optimizer", None) is not client_optimizer:
            raise UsageError(
                "lr_scheduler= was built on another optimizer than optimizer=: the engine reads "
                "its rates from the optimizer you pass (or give a callable taking the optimizer "
                "megazero.initialize returns)"
            )
        return lr_scheduler
    return lr_scheduler(optimizer)  # DeepSpeed's callable: optimizer -> scheduler


def _dataloader(dataset, settings: ApiSettings, pgroups, collate_fn):
    """DeepSpeed's training dataloader: micro batches of this rank's share (DistributedSampler)."""
    from torch.utils.data import DataLoader, DistributedSampler

    sampler = (
        DistributedSampler(dataset, num_replicas=pgroups.dp.size, rank=pgroups.dp.rank) if pgroups.dp.size > 1 else None
    )
    return DataLoader(dataset, batch_size=settings.micro_batch, sampler=sampler, collate_fn=collate_fn)
