"""Assembles what a training run steps: this rank's model chunks (built by model_builder), the ZeRO
engine over them with its groups (dense and, apart, the experts'), the pipeline's p2p, the streams,
the RNG tracker and the timers, into one TrainState. Builds nothing from flags: it gets a
TrainConfig and process groups. The loop that steps it is megazero.training.loop.
"""

from __future__ import annotations

import dataclasses

import torch

from megazero.config.train_config import TrainConfig
from megazero.training.model_builder import build_model_chunks, make_init_fn
from megazero.training.muon_matrices import muon_matrix_of
from megazero.parallel.activation_offload import ActivationOffload
from megazero.parallel.finalize import counts_in_norm, summed_across_stages
from megazero.parallel.process_groups import ProcessGroups
from megazero.parallel.pipeline.p2p import PipelineP2P
from megazero.parallel.pipeline.zero_bubble import V_SHAPED
from megazero.parallel.random import RNGTracker, seed_everything
from megazero.core.streams import Streams, Timers
from megazero.training.phases import Phases, Timed
from megazero.training.stragglers import StragglerWatch
from megazero.models.documents import DocumentMasking
from megazero.zero.engine import ZeroEngine
from megazero.zero.zero_groups import ZeroGroups


@dataclasses.dataclass
class TrainState:
    cfg: TrainConfig
    groups: ProcessGroups
    chunks: list
    engine: ZeroEngine
    device: torch.device
    streams: Streams
    tracker: RNGTracker
    p2p: PipelineP2P | None = None
    timers: Timers | None = None  # wall_clock_breakdown: forward / backward / reduce / step
    iteration: int = 0
    stragglers: StragglerWatch | None = None  # --straggler-threshold > 0
    documents: DocumentMasking | None = None  # --reset-position-ids / --reset-attention-mask / --eod-mask-loss
    phases: Phases = dataclasses.field(default_factory=Phases)  # who hears the run's phases
    offload: ActivationOffload | None = None  # --cpu-offloading


# Megatron's is_embedding_or_output_parameter: the parameters --decoupled-lr gives their own rate.
EMBEDDING_OR_OUTPUT = ("embedding.word.weight", "output_head.weight")


def lr_group(name: str) -> int:
    """1 for the input embedding and the output layer (lr group 1 of a decoupled step), else 0."""
    return int(name in EMBEDDING_OR_OUTPUT)


def zero_groups(groups: ProcessGroups) -> ZeroGroups:
    """ZeRO's groups from the grid's (ZeroGroups.from_grid)."""
    return ZeroGroups.from_grid(groups)


def experts_apart(topology) -> bool:
    """Whether expert weights need groups of their own (expert parallelism, or whole experts
    under tensor parallelism: their gradients then sum over the tensor-parallel ranks too)."""
    return topology.ep > 1 or topology.experts_fold_tp


def expert_zero_groups(groups: ProcessGroups) -> ZeroGroups:
    """ZeRO's groups for expert weights: the expert-data-parallel ranks, sharded inside each MiCS
    shard group (topology.expert_shard_groups) and replicated across them. With whole experts
    (etp 1) the expert groups span the tensor-parallel ranks, so the expert part of a norm is
    summed over the pipeline stages alone."""
    whole = groups.topology.experts_fold_tp
    return ZeroGroups(
        dp=groups.edp,
        shard=groups.expert_shard,
        replica=groups.expert_replica,
        model_parallel=groups.pp if whole else groups.mp,
        gather=groups.edp_gather,
        tensor=groups.tp,
    )


def document_masking(data, eod: int | None) -> DocumentMasking | None:
    """Megatron's document flags of a DataConfig with the tokenizer's end-of-document id (the data
    knows it: megazero.data.run_data); None when no flag is on."""
    flags = dict(
        reset_position_ids=data.reset_position_ids,
        reset_attention_mask=data.reset_attention_mask,
        eod_mask_loss=data.eod_mask_loss,
    )
    if not any(flags.values()):
        return None
    if eod is None:
        raise ValueError("document masking needs the end-of-document id (setup's eod)")
    return DocumentMasking(eod=eod, **flags)


def setup(cfg: TrainConfig, groups: ProcessGroups, device="cpu", eod: int | None = None) -> TrainState:
    """The run's state on this rank; `eod`: the tokenizer's end-of-document id, which document
    masking (cfg.data's flags) needs."""
    device = torch.device(device)
    documents = document_masking(cfg.data, eod)
    par = cfg.parallel
    timers = Timers(device) if cfg.wall_clock_breakdown else None
    threshold = cfg.run.straggler_threshold
    watch = StragglerWatch(threshold, groups.dp.device, groups.log) if threshold > 0 else None
    phases = Phases(*(Timed(t) for t in (timers, watch) if t is not None))
    tracker = seed_everything(cfg.seed, groups.coords.tp, groups.coords.pp, device)
    with phases("build"):
        chunks = build_model_chunks(
            cfg.model,
            groups,
            tracker,
            sequence_parallel=par.sequence_parallel,
            virtual_stages=par.virtual_stages,
            layer_split=par.layer_split,
            compile_backend=cfg.compile_backend,
            cp_comm_type=par.cp_comm_type,
            moe_dispatcher=par.moe_dispatcher,
            v_shape=par.schedule in V_SHAPED,
        )
    streams = Streams(device)
    offload = None
    if par.cpu_offloading_num_layers:  # hooks on the pure chunks, before ZeRO's (they skip parameters)
        offload = ActivationOffload(device, streams, par.cpu_offloading_num_layers)
        for chunk in chunks:
            offload.apply(chunk)
    engine = ZeroEngine(
        chunks,
        _in_phase(phases, "initial value", make_init_fn(cfg.model, cfg.seed)),
        groups=zero_groups(groups),
        zero=cfg.zero,
        adam=cfg.optimizer.adam,
        precision=cfg.precision,
        clip_grad=cfg.optimizer.clip_grad,
        device=device,
        counts_in_norm=lambda p: counts_in_norm(p, groups),
        isolated=summed_across_stages,
        streams=streams,
        lr_group=lr_group if cfg.optimizer.decoupled_lr is not None else None,
        expert_groups=expert_zero_groups(groups) if experts_apart(groups.topology) else None,
        expert_parallel=groups.ep,
        muon=cfg.optimizer.muon,
        muon_matrix=muon_matrix_of(cfg.model, cfg.optimizer.muon) if cfg.optimizer.muon else None,
    )
    for chunk in chunks:
        chunk.train()
    p2p = None
    if groups.topology.pp > 1:  # built once: its constructor joins a warm-up collective
        seq = cfg.model.seq_length // groups.topology.cp // (groups.topology.tp if par.sequence_parallel else 1)
        p2p = PipelineP2P(
            groups.pp, (cfg.micro_batch_size, seq, cfg.model.hidden_size), engine.precision.param_dtype, device
        )
    return TrainState(
        cfg,
        groups,
        chunks,
        engine,
        device,
        streams,
        tracker,
        p2p,
        timers,
        stragglers=watch,
        documents=documents,
        phases=phases,
        offload=offload,
    )


def _in_phase(phases: Phases, name: str, fn):
    """`fn` whose every call is the phase `name`."""

    def called(*args, **kwargs):
        with phases(name):
            return fn(*args, **kwargs)

    return called
