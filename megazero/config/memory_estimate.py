"""A first estimate of one rank's memory for a training run, and the machine's memory to hold it.

Used before any work starts to refuse runs that clearly cannot fit (the estimate, which leaves out
buffers, fragmentation and the framework's own use, exceeds what is available); kept apart so the
memory planner can reuse the formulas.

Model states, per parameter of this rank's model shard (Psi), with N the ZeRO shard count
(data-parallel size, or the MiCS shard size), as megazero's ZeRO storage allocates them:
p = weight bytes (2 in bf16/fp16, 4 in fp32); g = gradient accumulation bytes (4 unless
data_types.grad_accum_dtype is 16-bit); m = the separate fp32 master (4 with 16-bit weights, 0 in
fp32, where this rank's fp32 partition *is* its chunk of the weights); s = Adam's two moments (8 in
fp32; 2 less for each one --exp-avg-dtype / --exp-avg-sq-dtype keeps in bf16: 4 with both).

    stage 0: p + g + m + s    stage 1: p + g + (m + s)/N    stage 2: p + (g + m + s)/N
    stage 3: (p + g + m + s)/N

(tests/zero/test_engine_accounting.py checks the engine's own report against the same table, and
tests/config/test_memory_estimate.py each of its categories, params/grads/master/optimizer_states,
against the split `model_state_bytes_by_kind` makes of it; the planner also counts stage 3's persistent
parameters, under param_persistence_threshold, which stay whole in a stage-2 group.)

Communication and transient buffers ("comm_buffers"): megazero/config/comm_memory.py; what offload
moves off the device: megazero/config/offload_memory.py. Activations: megazero/config/activation_memory.py
(re-exported here).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from megazero.config.train_config import TrainConfig
from megazero.core.records import Record
from megazero.config.attention_memory import kernel_for
from megazero.config.comm_memory import comm_buffer_bytes
from megazero.config.moe_memory import moe_layer_extra, moe_layer_persistent_extra, stage_moe_layers
from megazero.config.offload_memory import (  # noqa: F401 - OFFLOAD_CATEGORIES re-exported: the planner's names
    OFFLOAD_CATEGORIES,
    offloaded_bytes,
    resident_fraction,
)
from megazero.config.activation_memory import (  # noqa: F401 - re-exported: the planner's names
    activation_bytes,
    cp_mask_bytes,
    cp_saved_per_layer,
    cp_transient_bytes,
    interleaved_in_flight,
    weight_grad_bytes,
    zero_bubble_in_flight,
    zero_bubble_peaks,
    layer_activation_split,
    layer_activation_units,
    output_layer_bytes,
)
from megazero.config.parameter_counts import (  # noqa: F401 - re-exported: the planner's names
    largest_module_params,
    largest_param,
    parameter_counts,
    persistent_counts,
)
from megazero.parallel.pipeline.zero_bubble import V_SHAPED, ZERO_BUBBLE_SCHEDULES

GIB = 2**30


MODEL_STATE_KINDS = ("params", "grads", "master", "optimizer_states")  # the engine's memory.report() keys
DEVICE_CATEGORIES = MODEL_STATE_KINDS + ("activations", "comm_buffers")
CATEGORIES = DEVICE_CATEGORIES + OFFLOAD_CATEGORIES


def model_state_bytes_by_kind(
    stage: int, shards: int, weight_bytes: int, grad_bytes: int, separate_master: bool, state_bytes: int = 8
) -> dict[str, float]:
    """Bytes per parameter of the model shard that ZeRO `stage` keeps on each of `shards` ranks, by
    kind: stage 1 partitions the master and moments, stage 2 also gradients, stage 3 also weights.
    `state_bytes`: both Adam moments' (8 in fp32, 4 in bf16)."""
    master = 4 if separate_master else 0
    return {
        "params": weight_bytes / shards if stage >= 3 else weight_bytes,
        "grads": grad_bytes / shards if stage >= 2 else grad_bytes,
        "master": master / shards if stage >= 1 else master,
        "optimizer_states": state_bytes / shards if stage >= 1 else state_bytes,
    }


def model_state_bytes_per_param(
    stage: int, shards: int, weight_bytes: int, grad_bytes: int, separate_master: bool, state_bytes: int = 8
) -> float:
    """Bytes per parameter of the model shard that ZeRO `stage` keeps on each of `shards` ranks."""
    return sum(
        model_state_bytes_by_kind(stage, shards, weight_bytes, grad_bytes, separate_master, state_bytes).values()
    )


class RankLayout(Record):
    """What one rank of the largest pipeline stage holds, as counts and byte widths."""

    parameters: int  # the whole model
    rank_parameters: int  # this rank's shard of the largest pipeline stage (before ZeRO)
    persistent_parameters: int  # of which stage 3 keeps whole (under param_persistence_threshold)
    expert_parameters: int = 0  # this rank's MoE experts (1/ep of them, split over TP), not in the above
    expert_shards: int = 1  # ZeRO partitions of the experts (the expert-data-parallel size)
    weight_bytes: int
    grad_bytes: int
    state_bytes: int = 8  # both Adam moments per parameter (4 with both in bf16)
    shards: int  # ZeRO partitions (data-parallel size, or the MiCS shard size)
    layers_per_stage: int
    in_flight: int  # microbatches a stage holds activations for at once
    microbatches: int = 1  # per step and data-parallel rank


def rank_layout(cfg: TrainConfig, world_size: int) -> RankLayout:
    model, par, prec = cfg.model, cfg.parallel, cfg.precision
    tp, pp, cp = par.tensor_parallel, par.pipeline_parallel, par.context_parallel
    dp = world_size // (tp * pp * cp)
    embedding, layer, head = parameter_counts(model)
    layers_per_stage = math.ceil(model.num_layers / pp)
    # A tied output layer on its own last stage keeps a copy of the word embedding; a V schedule
    # (zbv, dualpipev) runs the first and the last virtual stage on stage 0, which holds both.
    v_shaped = par.schedule in V_SHAPED and pp > 1
    tied_copy = model.padded_vocab_size * model.hidden_size if model.tie_embeddings and pp > 1 and not v_shaped else 0
    first = embedding + layers_per_stage * layer + (head if pp == 1 or v_shaped else 0)
    last = layers_per_stage * layer + (0 if v_shaped else head + tied_copy)
    extra, experts = moe_layer_extra(model)
    moe_first = stage_moe_layers(model, range(layers_per_stage))
    moe_last = stage_moe_layers(model, range(model.num_layers - layers_per_stage, model.num_layers))
    first, last = first + moe_first * extra, last + moe_last * extra
    ep = par.expert_parallel
    # whole experts (etp 1 under tp): not split over tp, their groups cut from tp x dp x cp ranks
    expert_tp = 1 if par.expert_tensor_parallel == 1 else tp
    mics = cfg.zero.mics_shard_size
    expert_shards = (tp // expert_tp) * dp * cp // ep
    if 0 < mics < dp * cp:  # MiCS: the edp ranks inside a shard group
        expert_shards = mics // ep if mics % ep == 0 else 1
    persistent = 0
    if cfg.zero.stage == 3:
        p_embedding, p_layer, p_head = persistent_counts(model, tp, cfg.zero.param_persistence_threshold)
        p_tied = tied_copy if tied_copy // tp <= cfg.zero.param_persistence_threshold else 0
        p_moe = moe_layer_persistent_extra(model, tp, cfg.zero.param_persistence_threshold)
        persistent = (
            p_embedding + layers_per_stage * p_layer + moe_first * p_moe + (p_head if pp == 1 or v_shaped else 0)
            if first >= last
            else layers_per_stage * p_layer + moe_last * p_moe + p_head + p_tied
        )
    microbatches = cfg.num_microbatches(dp)
    return RankLayout(
        parameters=embedding
        + model.num_layers * layer
        + head
        + stage_moe_layers(model, range(model.num_layers)) * (extra + experts),
        expert_parameters=math.ceil(max(moe_first if first >= last else moe_last, 0) * experts / ep / expert_tp),
        expert_shards=max(expert_shards, 1),
        rank_parameters=math.ceil(max(first, last) / tp),
        persistent_parameters=math.ceil(persistent / tp),
        weight_bytes=2 if prec.bf16 or prec.fp16 else 4,
        grad_bytes=2 if prec.grad_accum_dtype != "fp32" else 4,
        state_bytes=sum(2 if dtype == "bf16" else 4 for dtype in (prec.exp_avg_dtype, prec.exp_avg_sq_dtype)),
        shards=cfg.zero.mics_shard_size if cfg.zero.mics_shard_size > 0 else dp * cp,  # ZeRO: dp x cp
        layers_per_stage=layers_per_stage,
        in_flight=microbatches if par.schedule == "gpipe" else min(pp, microbatches),
        microbatches=microbatches,
    )


def _activations(cfg: TrainConfig, r: RankLayout, device_type: str | None = None, host: bool = False) -> float:
    """The activations of the largest stage; with `device_type`, what its attention kernel allocates;
    `host`: what activation offload keeps in host memory instead."""
    m, par = cfg.model, cfg.parallel
    away = dict(offloaded=par.cpu_offloading_num_layers, host=host)
    kernel = kernel_for(cfg, device_type)
    data = cfg.data
    documents = data if data.reset_position_ids or data.reset_attention_mask or data.eod_mask_loss else None
    chunks = [math.ceil(r.layers_per_stage / par.virtual_stages)] * par.virtual_stages
    in_flight, layers = r.in_flight, r.layers_per_stage
    if par.schedule in ZERO_BUBBLE_SCHEDULES and par.pipeline_parallel > 1:
        return _zero_bubble_activations(cfg, r, kernel, chunks)
    if par.virtual_stages > 1 and par.schedule != "gpipe":
        in_flight = interleaved_in_flight(par.pipeline_parallel, par.virtual_stages, r.microbatches)
    elif par.pipeline_parallel > 1 and par.schedule != "gpipe":
        # 1F1B: stage s holds min(pp - s, microbatches) microbatches of its own layers, and only
        # the last stage the output layer (one microbatch in flight there): the planner answers for
        # the stage that holds the most
        pp = par.pipeline_parallel
        split = par.layer_split or [r.layers_per_stage] * pp
        stages = [(n, min(pp - s, r.microbatches), s == pp - 1) for s, n in enumerate(split)]
        return max(
            activation_bytes(
                m.seq_length,
                cfg.micro_batch_size,
                m,
                n,
                par.tensor_parallel,
                held,
                r.weight_bytes,
                [n],
                par.context_parallel,
                par.cp_comm_type,
                par.sequence_parallel,
                with_head=last,
                ep=par.expert_parallel,
                kernel=kernel,
                documents=documents,
                microbatches=r.microbatches,
                **away,
            )
            for n, held, last in stages
        )
    return activation_bytes(
        m.seq_length,
        cfg.micro_batch_size,
        m,
        layers,
        par.tensor_parallel,
        in_flight,
        r.weight_bytes,
        chunks,
        par.context_parallel,
        par.cp_comm_type,
        par.sequence_parallel,
        ep=par.expert_parallel,
        kernel=kernel,
        documents=documents,
        microbatches=r.microbatches,
        **away,
    )


def _zero_bubble_activations(cfg: TrainConfig, r: RankLayout, kernel: str, chunks: list[int]) -> float:
    """The largest stage's activations under a zero-bubble schedule: stage s holds its list's peak
    of activations and waiting Ws' GEMM inputs and output gradients (zero_bubble_peaks) of its own
    layers. Where the loss is (the last stage, or stage 0 in a V) each waiting W also keeps the
    output layer's input (with fp32 maxes, sums and loss gradients: models/loss.py), and the loss
    chunk's B and its W each make the logits and their gradient again (output_layer_bytes). A W makes
    its chunk's weight gradients (fp32 sums deposited, and the 16-bit zeros autograd gets for them)
    before handing them over at once; under sequence parallelism it gathers a GEMM's input again."""
    m, par = cfg.model, cfg.parallel
    pp, v, tp, layers = par.pipeline_parallel, par.virtual_stages, par.tensor_parallel, r.layers_per_stage
    loss_stage = 0 if par.schedule in V_SHAPED else pp - 1
    tokens = m.seq_length * cfg.micro_batch_size // par.context_parallel

    def acts(held):
        return activation_bytes(
            m.seq_length,
            cfg.micro_batch_size,
            m,
            layers,
            tp,
            held,
            r.weight_bytes,
            chunks,
            par.context_parallel,
            par.cp_comm_type,
            par.sequence_parallel,
            with_head=False,
            ep=par.expert_parallel,
            kernel=kernel,
        )

    fixed = acts(0)
    inputs, grads = weight_grad_bytes(tokens, m, layers, tp, r.weight_bytes, par.sequence_parallel, par.expert_parallel)
    head_inputs = tokens * (m.hidden_size * r.weight_bytes + 12)
    w_transient = parameter_counts(m)[1] / tp * layers / v * (4 + r.weight_bytes if r.weight_bytes < 4 else 4)
    if par.sequence_parallel and tp > 1:
        w_transient += tokens * m.hidden_size * r.weight_bytes
    loss = output_layer_bytes(tokens, m, tp, r.weight_bytes)

    def peaks(w_inputs):
        return zero_bubble_peaks(
            par.schedule, pp, v, r.microbatches, acts(1) - fixed, w_inputs, grads, w_transient, loss, loss_stage
        )

    plain, at_loss = peaks(inputs), peaks(inputs + head_inputs)
    return fixed + max(at_loss[s] if s == loss_stage else plain[s] for s in range(pp))


def plan_bytes(cfg: TrainConfig, world_size: int) -> dict[str, float]:
    """One rank's bytes by category (CATEGORIES: DEVICE_CATEGORIES on the device, then host memory
    and disk), for the largest pipeline stage."""
    r = rank_layout(cfg, world_size)
    by_kind = lambda stage: model_state_bytes_by_kind(  # noqa: E731
        stage, r.shards, r.weight_bytes, r.grad_bytes, separate_master=r.weight_bytes == 2, state_bytes=r.state_bytes
    )
    # Stage 3 keeps its persistent parameters in a stage-2 group: weights whole, the rest partitioned.
    partitioned, persistent = by_kind(cfg.zero.stage), by_kind(2)
    experts = model_state_bytes_by_kind(
        cfg.zero.stage,
        r.expert_shards,
        r.weight_bytes,
        r.grad_bytes,
        separate_master=r.weight_bytes == 2,
        state_bytes=r.state_bytes,
    )
    out = {
        kind: (r.rank_parameters - r.persistent_parameters) * partitioned[kind]
        + r.persistent_parameters * persistent[kind]
        + r.expert_parameters * experts[kind]
        for kind in MODEL_STATE_KINDS
    }
    out["activations"] = _activations(cfg, r)
    out["comm_buffers"] = comm_buffer_bytes(cfg, r, out["activations"])
    offloaded = offloaded_bytes(cfg, r)
    if cfg.zero.offloads_optimizer:  # a separate fp32 master for the part kept on the device
        partition = r.rank_parameters / r.shards
        resident = partition * resident_fraction(cfg.zero, partition)
        out["master"], out["optimizer_states"] = 4 * resident, r.state_bytes * resident
        if cfg.zero.zenflow is not None:  # the selected columns' states and indices (two int64 each)
            selected = partition * cfg.zero.zenflow.topk_ratio
            moments = 0 if cfg.zero.zenflow.offload else 8 * selected  # offload: in host memory
            out["master"], out["optimizer_states"] = 4 * selected, 16 * selected + moments
            offloaded["host_optimizer_states"] += 8 * selected - moments
    out["params"] -= offloaded["host_params"] + offloaded["nvme_params"]
    offloaded["host_activations"] = _activations(cfg, r, host=True) if cfg.parallel.cpu_offloading_num_layers else 0.0
    return {**out, **offloaded}


def device_bytes(plan: dict[str, float]) -> float:
    """What a plan puts on the device (the sum that must fit in its memory)."""
    return sum(plan[key] for key in DEVICE_CATEGORIES)


class MemoryEstimate(Record):
    parameters: int  # the whole model
    rank_parameters: int  # this rank's shard of the largest pipeline stage
    bytes_per_param: float
    model_states: float  # bytes
    activations: float  # bytes
    attention: float = 0.0  # of the activations: what the device's attention kernel adds (math: s^2)
    kernel: str = "unknown"  # that kernel (config/attention_memory.py)

    @property
    def total(self) -> float:
        return self.model_states + self.activations


def estimate(cfg: TrainConfig, world_size: int, device_type: str = "cpu") -> MemoryEstimate:
    """Model states and activations one rank needs in the memory of `device_type`: offloaded states
    leave a GPU's count; on the CPU only what is swapped to files leaves it (host memory is the
    same memory there)."""
    r = rank_layout(cfg, world_size)  # the first check: persistent stage-3 parameters ignored
    away = ("nvme",) if device_type == "cpu" else ("cpu", "nvme")

    def per_param(shards: int) -> float:
        kinds = model_state_bytes_by_kind(
            cfg.zero.stage,
            shards,
            r.weight_bytes,
            r.grad_bytes,
            separate_master=r.weight_bytes == 2,
            state_bytes=r.state_bytes,
        )
        if cfg.zero.offloads_optimizer and cfg.zero.offload_optimizer.device in away:
            kept = resident_fraction(cfg.zero, r.rank_parameters / r.shards) / shards
            kinds["master"], kinds["optimizer_states"] = 4 * kept, r.state_bytes * kept
        if cfg.zero.offloads_params and cfg.zero.offload_param.device in away:
            kinds["params"] = 0.0
        return sum(kinds.values())

    dense = per_param(r.shards)
    # The experts' states are partitioned over their own (expert data parallel) ranks.
    model_states = r.rank_parameters * dense + r.expert_parameters * per_param(r.expert_shards)
    activations, kernel = _activations(cfg, r, device_type), kernel_for(cfg, device_type)
    return MemoryEstimate(
        parameters=r.parameters,
        rank_parameters=r.rank_parameters,
        bytes_per_param=dense,
        model_states=model_states,
        activations=activations,
        attention=activations - _activations(cfg, r),
        kernel=kernel,
    )


def available_bytes(device: torch.device, ranks_on_node: int) -> tuple[float, str] | None:
    """Memory this rank may use and how it was found; None where it cannot be read."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return float(free), f"free on {device}"
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("MemAvailable:"):
            total = float(line.split()[1]) * 1024
            ranks = max(1, ranks_on_node)
            return total / ranks, f"MemAvailable {total / GIB:.1f} GiB / {ranks} rank(s) on this node"
    return None


def describe_refusal(cfg: TrainConfig, found: MemoryEstimate, available: float, how: str) -> str:
    attention = ""
    if found.attention > 0:
        why = (
            " (torch's flash kernel takes no dropout there: --attention-dropout 0 runs it)"
            if (cfg.model.attention_dropout > 0)
            else ""
        )
        attention = (
            f", of which {found.attention / GIB:.1f} GiB are the {found.kernel} attention kernel's "
            f"(b, heads, s, s) probabilities{why}"
        )
    return (
        f"this run needs about {found.total / GIB:.1f} GiB per rank but {available / GIB:.1f} GiB is "
        f"available ({how}): model states {found.model_states / GIB:.1f} GiB ({found.parameters / 1e6:.1f}M "
        f"parameters, {found.rank_parameters / 1e6:.1f}M on the largest rank at {found.bytes_per_param:g} "
        f"bytes each, ZeRO stage {cfg.zero.stage}), activations {found.activations / GIB:.1f} GiB "
        f"(--seq-length {cfg.model.seq_length} x --micro-batch-size {cfg.micro_batch_size}{attention}); lower "
        f"--seq-length, --micro-batch-size or the model size, or spread it (--zero-stage, "
        f"--tensor-model-parallel-size, --pipeline-model-parallel-size, --recompute-activations)"
    )
