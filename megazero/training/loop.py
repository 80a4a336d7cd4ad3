"""The training loop: model chunks + ZeRO engine + pipeline schedule, step after step.

Owns the order of a step (begin, schedule of microbatch forwards/backwards, optimizer step), the
loss bookkeeping (each microbatch's loss is its summed token losses over the tokens of the whole
global batch, so DP ranks and microbatches add up to the global mean whatever the layout) and
evaluation. Builds nothing from flags: it gets a TrainConfig, process groups and batch sources.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import torch

from megazero.core import comm, host_read
from megazero.training.flops import peak_tflops, recompute_flops, step_flops
from megazero.parallel.context_parallel import local_chunks
from megazero.parallel.finalize import finalize_model_grads
from megazero.parallel.pipeline.split import stage_layer_ranges
from megazero.parallel.pipeline.schedules import PipelineJob, get_schedule, make_backward, make_split_backward
from megazero.parallel.pipeline.zero_bubble import V_SHAPED
from megazero.core.streams import copy_to_device
from megazero.training.divergence import Diverged, DivergenceWatch
from megazero.training.housekeeping import Housekeeping
from megazero.training.stragglers import find_stragglers
from megazero.training.phases import Phases
from megazero.training.metrics import train_record
from megazero.training.moe_stats import begin_moe_step, collapse_line, end_moe_step
from megazero.data.sampler import MicrobatchSource
from megazero.models.documents import pack_documents
from megazero.training.assembly import TrainState


def _unheard(name: str):
    return contextlib.nullcontext()


def _job(state: TrainState, microbatches: list[torch.Tensor], phases: Phases | None = None) -> PipelineJob:
    cfg, groups = state.cfg, state.groups
    phases = phases if phases is not None else _unheard  # evaluation: nothing listens
    # Every microbatch's summed token losses over the tokens of the whole global batch (Megatron's
    # --calculate-per-token-loss; every token counts, so it is also the mean of the per-sample means).
    normalizer = len(microbatches) * cfg.micro_batch_size * groups.topology.dp * cfg.model.seq_length
    cp = groups.cp  # CP ranks' token sums add up to the same count
    # Pinned, non-blocking copies on the copy stream, issued for the whole batch up front.
    tokens_on_device = [copy_to_device(mb, state.device, state.streams) for mb in microbatches]
    documents, loss_masks, normalizer = _packed_documents(state, microbatches, normalizer)
    engine_backward = make_backward(state.engine.backward)

    def forward(chunk_index: int, input_tensor, mb: int):
        with phases("forward"):
            chunk = state.chunks[chunk_index]
            tokens = tokens_on_device[mb]
            # Context parallelism: this rank's chunks of every sample (inputs and labels alike)
            inputs = local_chunks(tokens[:, :-1], cp.rank, cp.size) if chunk.embedding is not None else input_tensor
            labels = local_chunks(tokens[:, 1:], cp.rank, cp.size) if chunk.output_head is not None else None
            out = chunk(inputs, labels, documents[mb])
            if labels is None:
                return out
            if loss_masks[mb] is not None:
                return (out.float() * loss_masks[mb]).sum() / normalizer
            return out.float().sum() / normalizer

    def backward(output, output_grad, last: bool) -> None:
        with phases("backward"):
            engine_backward(output, output_grad, last)

    split_input, split_weight = make_split_backward(state.engine.backward_input, state.engine.backward_weight)

    def backward_input(output, output_grad, ticket) -> None:
        with phases("backward"):
            split_input(output, output_grad, ticket)

    def backward_weight(run_w, ticket, last: bool) -> None:
        with phases("backward"):
            split_weight(run_w, ticket, last)

    return PipelineJob(
        num_microbatches=len(microbatches),
        num_chunks=len(state.chunks),
        stage=groups.coords.pp,
        num_stages=groups.topology.pp,
        forward=forward,
        backward=backward,
        p2p=state.p2p,
        overlap_p2p=cfg.parallel.overlap_p2p_comm,
        backward_input=backward_input,
        backward_weight=backward_weight,
    )


def loss_stage(state: TrainState) -> int:
    """The pipeline stage whose last chunk computes the loss: the last, or the first under a V
    schedule (zbv, dualpipev), whose last virtual stage is stage 0's second chunk."""
    return 0 if state.cfg.parallel.schedule in V_SHAPED else state.groups.topology.pp - 1


def _packed_documents(state: TrainState, microbatches: list[torch.Tensor], normalizer):
    """Document masking's inputs for each microbatch: the Documents the model takes (whole samples,
    on every stage and CP rank alike: each holds the whole microbatch's tokens and builds them on the
    host from those; models/documents.py), this rank's loss masks (its CP chunks), and the loss
    normalizer: with --eod-mask-loss the global batch's unmasked tokens, summed over dp x cp on the
    last stage (a one-element all-reduce per step), so every layout divides by the same count."""
    masking, n = state.documents, len(microbatches)
    if masking is None:
        return [None] * n, [None] * n, normalizer
    groups, device, streams = state.groups, state.device, state.streams
    packed = [pack_documents(mb[:, :-1], masking) for mb in microbatches]
    documents = [None if d is None else d.to(lambda t: copy_to_device(t, device, streams)) for d, _ in packed]
    if not masking.eod_mask_loss:
        return documents, [None] * n, normalizer
    cp = groups.cp
    local = [local_chunks(mask, cp.rank, cp.size) for _, mask in packed]
    masks = [copy_to_device(mask, device, streams) for mask in local]
    if groups.is_last_stage:
        count = torch.full(
            (1,), float(sum(int(mask.sum()) for mask in local)), dtype=torch.float64, device=groups.dp.device
        )
        comm.all_reduce(count, groups.dp)
        normalizer = count.clamp_min(1.0).float().squeeze(0)
    return documents, masks, normalizer


def _global_loss(
    state: TrainState, losses: list[torch.Tensor], flags: tuple[bool, ...] = ()
) -> tuple[float, tuple[bool, ...]]:
    """Sum of the last stage's microbatch losses over DP, sent to every pipeline stage, and each of
    this rank's `flags` (stop conditions) made true on every rank when it is true on any rank of
    the layout: the flags ride in the loss's own reduction, so agreeing on them costs no extra
    collective and no extra host sync. With flags the reduction is over DP, then over TP x PP
    instead of a broadcast over PP: the loss enters once (last stage, TP rank 0; the other ranks
    add zeros, which leaves its float64 sum bitwise as it was) and the flags add up as counts."""
    groups = state.groups
    total = torch.zeros(1 + len(flags), dtype=torch.float64, device=state.device)
    at_loss = groups.coords.pp == loss_stage(state)
    counts_loss = at_loss and (not flags or groups.coords.tp == 0)
    if counts_loss and losses:
        total[:1] += torch.stack(losses).double().sum()
    if flags:
        for i, flag in enumerate(flags, start=1):
            if flag:  # a fill on the device: no host-to-device copy
                total[i].fill_(1.0)
        comm.all_reduce(total, groups.dp)
        comm.all_reduce(total, groups.mp)
    else:
        if at_loss:
            comm.all_reduce(total, groups.dp)
        comm.broadcast(total, loss_stage(state), groups.pp)
    values = host_read.read(total, "loss and stop flags", healthy=lambda: [1.0] + [float(f) for f in flags])
    return values[0], tuple(v > 0 for v in values[1:])


@dataclasses.dataclass
class StepResult:
    loss: float
    grad_norm: float
    skipped: bool
    loss_scale: float
    max_in_flight: int
    stop_flags: tuple[bool, ...] = ()  # stop_flags()'s values, each agreed over the layout
    num_zeros_in_grad: int | None = None  # --log-num-zeros-in-grad
    moe: dict | None = None  # mixture of experts: moe_stats.end_moe_step's record
    max_deferred_w: int = 0  # zero-bubble schedules: most Ws waiting at once


def train_step(state: TrainState, microbatches: list[torch.Tensor], lr, stop_flags=None) -> StepResult:
    """One training step at learning rate `lr` (a float, or (lr, decoupled lr)). `stop_flags()`
    (called after the optimizer step) gives this rank's stop conditions (e.g. the wall clock is past
    --exit-duration-in-mins, a signal came), agreed over the whole layout in the loss's reduction
    (`_global_loss`)."""
    with state.phases("train step"):
        return _train_step(state, microbatches, lr, stop_flags)


def _train_step(state: TrainState, microbatches: list[torch.Tensor], lr, stop_flags) -> StepResult:
    par = state.cfg.parallel
    schedule = get_schedule(par.schedule, state.groups.topology.pp, par.virtual_stages, len(microbatches))
    state.engine.begin_step()
    moe = state.cfg.model.num_experts > 0
    if moe:
        begin_moe_step(state.chunks, len(microbatches), state.groups.topology.dp, state.engine.loss_scaler.scale)
    result = schedule(_job(state, microbatches, state.phases), forward_only=False)
    with state.phases("reduce"):
        state.engine.finish_gradients()
        finalize_model_grads(state.engine.parameters(), state.engine.grad_pieces, state.groups)
    run = state.cfg.run
    if run.empty_unused_memory_level >= 1:
        empty_cache(state.device)
    zeros = state.engine.counted_stats("grad")[1] if run.log_num_zeros_in_grad else None
    with state.phases("step"):
        stats = state.engine.step(lr)
    state.iteration += 1
    moe_record = (
        end_moe_step(
            state.chunks, state.groups, state.cfg.model, len(microbatches), par.sequence_parallel, state.device
        )
        if moe
        else None
    )
    loss, agreed = _global_loss(state, result.losses, stop_flags() if stop_flags is not None else ())
    state.groups.log.end_step()
    if run.empty_unused_memory_level >= 2:
        empty_cache(state.device)
    return StepResult(
        loss,
        stats.grad_norm,
        stats.skipped,
        stats.loss_scale,
        result.max_in_flight,
        agreed,
        zeros,
        moe_record,
        result.max_deferred_w,
    )


def empty_cache(device: torch.device) -> None:
    """Gives the caching allocator's unused blocks back to the device (--empty-unused-memory-level)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


@torch.no_grad()
def evaluate(state: TrainState, batches: list[list[torch.Tensor]]) -> float:
    """Mean token loss over the given global batches (forward only)."""
    par = state.cfg.parallel
    for chunk in state.chunks:
        chunk.eval()
    total = 0.0
    for microbatches in batches:
        schedule = get_schedule(par.schedule, state.groups.topology.pp, par.virtual_stages, len(microbatches))
        total += _global_loss(state, schedule(_job(state, microbatches), forward_only=True).losses)[0]
    for chunk in state.chunks:
        chunk.train()
    state.groups.log.end_step()  # evaluation traffic is not the next training step's
    return total / max(1, len(batches))


def peak_memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def train(
    state: TrainState,
    train_source: MicrobatchSource,
    valid_batches,
    lr_at,
    metrics=None,
    start_iteration: int = 0,
    policy=None,
) -> list[dict]:
    """Runs steps start_iteration+1 .. cfg.train_iters; returns one record per step (and per
    evaluation). `lr_at(n, done_samples)` is the rate(s) of the n-th applied optimizer step, after
    applied steps that consumed `done_samples` samples (megazero.training.lr_schedule.step_learning_rate).
    `policy` (megazero.checkpoint.SavePolicy) saves when due and may stop early. A run that
    diverged raises Diverged on every rank at the same iteration (megazero.training.divergence)."""
    cfg = state.cfg
    history, window = [], []
    chunk_layers = _chunk_layers(cfg)
    peak = peak_tflops(state.device)
    world = state.groups.topology.world_size
    housekeeping = Housekeeping(cfg.run, state.groups.rank, state.device, cfg.run_dir)
    consumed = cfg.consumed_before(start_iteration)
    # The schedule counts applied optimizer steps (Megatron's scheduler does not advance on a skipped
    # step; a checkpoint loaded without its optimizer restarts it), and in samples their samples.
    applied = cfg.consumed_before(state.engine.step_count)
    watch = DivergenceWatch.for_config(cfg, state.engine.loss_scaler.dynamic)
    moe_said = set()  # MoE layers already named for sending every token to one expert
    try:
        for it in range(start_iteration, cfg.train_iters):
            housekeeping.before_step(it + 1)
            batch = cfg.batch_at(it)
            tokens_per_step = batch * cfg.model.seq_length
            flops_per_step = step_flops(cfg.model, tokens_per_step)
            hardware_flops = flops_per_step + recompute_flops(cfg.model, tokens_per_step, chunk_layers)
            started = time.perf_counter()
            rates = lr_at(state.engine.step_count + 1, applied)
            lr = rates if isinstance(rates, float) else rates[0]
            step = train_step(state, train_source.batch(it), rates, policy.stop_flags if policy else None)
            elapsed = time.perf_counter() - started
            consumed += batch
            applied += 0 if step.skipped else batch
            record = train_record(
                it + 1,
                step,
                lr,
                elapsed,
                tokens=tokens_per_step,
                flops=flops_per_step,
                hardware_flops=hardware_flops,
                world=world,
                peak=peak,
                memory_mib=peak_memory_mib(state.device),
                skipped_total=state.engine.skipped_steps,
                flagged=_optional_fields(state, rates, batch, consumed, step),
                time_ms=state.timers.elapsed_ms() if state.timers is not None else None,
            )
            _say_step_notes(state, step, it + 1, moe_said, metrics)
            history.append(record)
            window.append(record)
            if state.stragglers is not None:
                _watch_stragglers(state, record, (it + 1) % cfg.log_interval == 0, it == start_iteration)
            if metrics is not None and ((it + 1) % cfg.log_interval == 0 or it == start_iteration):
                metrics.log_train(window, state.groups.log)
                window = []
            _check_divergence(watch, state, it + 1, step, metrics, window, policy)
            if valid_batches and ((it + 1) % cfg.eval_interval == 0 or it + 1 == cfg.train_iters):
                history.append(_evaluation(state, valid_batches, it + 1, housekeeping, metrics))
            housekeeping.after_step(it + 1)
            stop = policy.after_step(state, consumed, step.stop_flags, step.loss) if policy else None
            if stop:
                if metrics is not None:
                    metrics.say(f" stopping after iteration {it + 1} ({stop})")
                break
    finally:
        housekeeping.close()
    if policy is not None:
        policy.finish(state, consumed)
    return history


def _chunk_layers(cfg) -> list[int]:
    """Layers of every model chunk (pipeline stages x virtual stages, in pipeline order), which
    recompute_flops counts "block" recomputation in."""
    par = cfg.parallel
    return [
        len(r)
        for r in stage_layer_ranges(cfg.model.num_layers, par.pipeline_parallel, par.virtual_stages, par.layer_split)
    ]


def _say_step_notes(state: TrainState, step: StepResult, iteration: int, moe_said: set, metrics) -> None:
    """The step's lines beside its record: MoE layers that sent every token to one expert (each named
    once, `moe_said`), and a step skipped for a non-finite gradient norm."""
    collapsed = collapse_line(step.moe, state.cfg.model, iteration, moe_said) if step.moe is not None else None
    if collapsed and metrics is not None:
        metrics.say(f" {collapsed}")
    if step.skipped and metrics is not None:
        metrics.say(
            f" iteration {iteration}: non-finite gradient norm ({step.grad_norm}), step skipped "
            f"(loss scale {step.loss_scale:g}; {state.engine.skipped_steps} skipped so far)"
        )


def _evaluation(state: TrainState, valid_batches, iteration: int, housekeeping: Housekeeping, metrics) -> dict:
    """The validation loss after `iteration`, as a record (logged), inside housekeeping's pause."""
    housekeeping.around_evaluation()
    record = {"iteration": iteration, "split": "valid", "loss": evaluate(state, valid_batches)}
    housekeeping.around_evaluation()
    if metrics is not None:
        metrics.log_eval(record)
    return record


def _check_divergence(
    watch: DivergenceWatch, state: TrainState, iteration: int, step: StepResult, metrics, window: list[dict], policy
) -> None:
    """Says the divergence watch's warning; when it stops the run: the step's record logged, a
    pending save committed, then Diverged (the same on every rank: the watch reads agreed values)."""
    stop, warning = watch.after_step(iteration, step.loss, step.grad_norm, step.skipped)
    if warning is not None and metrics is not None:
        metrics.say(f" warning: {warning}")
    if stop is None:
        return
    if metrics is not None and window:
        metrics.log_train(window, state.groups.log)
    kept = policy.stop_without_saving() if policy is not None else "no checkpoint: no --save"
    what, fix = stop
    raise Diverged(f"{what}: the run diverged and stops, saving nothing of this state; {kept}; {fix}")


def _watch_stragglers(state: TrainState, record: dict, at_interval: bool, first: bool) -> None:
    """At each --log-interval iteration (on every rank: it gathers over the layout) the slowest rank
    over the threshold goes into `record` as "straggler". The run's first step (warm-up) is dropped
    unless it ends an interval; that needs no collective, so nothing is gathered then."""
    watch = state.stragglers
    watch.iterations += 1
    if at_interval:
        iterations = watch.iterations
        found = find_stragglers(watch.gather(state.groups), watch.threshold, iterations)
        if found is not None:
            record["straggler"] = found
    elif first:
        watch.reset()


def _optional_fields(state: TrainState, rates, batch: int, consumed: int, step: StepResult) -> dict:
    """The record's fields that flags ask for: the decoupled rate, the ramp's batch, the parameter
    norm (after the step) and the gradient's zeros."""
    cfg, out = state.cfg, {}
    if not isinstance(rates, float):
        out["decoupled_lr"] = rates[1]
    if cfg.rampup is not None:
        out.update(global_batch_size=batch, consumed_samples=consumed)
    if cfg.run.log_params_norm:
        out["params_norm"] = state.engine.counted_stats("fp32")[0]
    if step.num_zeros_in_grad is not None:
        out["num_zeros_in_grad"] = step.num_zeros_in_grad
    return out
