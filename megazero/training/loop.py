"""The training loop: model chunks + ZeRO engine + pipeline schedule, step after step.

Owns the order of a step (begin, schedule of microbatch forwards/backwards, optimizer step), the
loss bookkeeping (each microbatch's loss is its summed token losses over the tokens of the whole
global batch, so DP ranks and microbatches add up to the global mean whatever the layout) and
evaluation. Builds nothing from flags: it gets a TrainConfig, process groups and batch sources.
"""
from __future__ import annotations

import dataclasses
import time

import torch

from megazero.core import comm, host_read
from megazero.training.flops import peak_tflops, recompute_flops, step_flops
from megazero.parallel.context_parallel import local_chunks
from megazero.parallel.finalize import finalize_model_grads
from megazero.parallel.pipeline.split import stage_layer_ranges
from megazero.parallel.pipeline.schedules import PipelineJob, get_schedule, make_backward
from megazero.core.streams import copy_to_device
from megazero.training.housekeeping import Housekeeping
from megazero.training.stragglers import find_stragglers
from megazero.training.out_of_memory import mark_phase
from megazero.training.moe_stats import begin_moe_step, end_moe_step
from megazero.data.sampler import MicrobatchSource
from megazero.training.assembly import TrainState


class _Timed:
    """`with _Timed(timers, name):` times a phase on each of `timers` (wall_clock_breakdown's, the
    straggler watch's; none: nothing is timed)."""

    def __init__(self, timers: tuple, name: str):
        self.timers, self.name = timers, name

    def __enter__(self):
        for timers in self.timers:
            timers.start(self.name)

    def __exit__(self, kind, err, tb):
        mark_phase(err, self.name)          # an out-of-memory error's line names the phase
        for timers in self.timers:
            timers.stop(self.name)


def _job(state: TrainState, microbatches: list[torch.Tensor], timers: tuple = ()) -> PipelineJob:
    cfg, groups = state.cfg, state.groups
    # Every microbatch's summed token losses over the tokens of the whole global batch (Megatron's
    # --calculate-per-token-loss; every token counts, so it is also the mean of the per-sample means).
    normalizer = len(microbatches) * cfg.micro_batch_size * groups.topology.dp * cfg.model.seq_length
    cp = groups.cp     # CP ranks' token sums add up to the same count
    # Pinned, non-blocking copies on the copy stream, issued for the whole batch up front.
    tokens_on_device = [copy_to_device(mb, state.device, state.streams) for mb in microbatches]
    engine_backward = make_backward(state.engine.backward)

    def forward(chunk_index: int, input_tensor, mb: int):
        with _Timed(timers, "forward"):
            chunk = state.chunks[chunk_index]
            tokens = tokens_on_device[mb]
            # Context parallelism: this rank's chunks of every sample (inputs and labels alike)
            inputs = local_chunks(tokens[:, :-1], cp.rank, cp.size) if chunk.embedding is not None else input_tensor
            labels = local_chunks(tokens[:, 1:], cp.rank, cp.size) if chunk.output_head is not None else None
            out = chunk(inputs, labels)
            return out.float().sum() / normalizer if labels is not None else out

    def backward(output, output_grad, last: bool) -> None:
        with _Timed(timers, "backward"):
            engine_backward(output, output_grad, last)

    return PipelineJob(num_microbatches=len(microbatches), num_chunks=len(state.chunks),
                       stage=groups.coords.pp, num_stages=groups.topology.pp, forward=forward,
                       backward=backward, p2p=state.p2p, overlap_p2p=cfg.parallel.overlap_p2p_comm)


def _global_loss(state: TrainState, losses: list[torch.Tensor],
                 flags: tuple[bool, ...] = ()) -> tuple[float, tuple[bool, ...]]:
    """Sum of the last stage's microbatch losses over DP, sent to every pipeline stage, and each of
    this rank's `flags` (stop conditions) made true on every rank when it is true on any rank of
    the layout: the flags ride in the loss's own reduction, so agreeing on them costs no extra
    collective and no extra host sync. With flags the reduction is over DP, then over TP x PP
    instead of a broadcast over PP: the loss enters once (last stage, TP rank 0; the other ranks
    add zeros, which leaves its float64 sum bitwise as it was) and the flags add up as counts."""
    groups = state.groups
    total = torch.zeros(1 + len(flags), dtype=torch.float64, device=state.device)
    counts_loss = groups.is_last_stage and (not flags or groups.coords.tp == 0)
    if counts_loss and losses:
        total[:1] += torch.stack(losses).double().sum()
    if flags:
        for i, flag in enumerate(flags, start=1):
            if flag:                              # a fill on the device: no host-to-device copy
                total[i].fill_(1.0)
        comm.all_reduce(total, groups.dp)
        comm.all_reduce(total, groups.mp)
    else:
        if groups.is_last_stage:
            comm.all_reduce(total, groups.dp)
        comm.broadcast(total, groups.topology.pp - 1, groups.pp)
    values = host_read.read(total, "loss and stop flags", healthy=lambda: [1.0] + [float(f) for f in flags])
    return values[0], tuple(v > 0 for v in values[1:])


@dataclasses.dataclass
class StepResult:
    loss: float
    grad_norm: float
    skipped: bool
    loss_scale: float
    max_in_flight: int
    stop_flags: tuple[bool, ...] = ()     # stop_flags()'s values, each agreed over the layout
    num_zeros_in_grad: int | None = None  # --log-num-zeros-in-grad
    moe: dict | None = None               # mixture of experts: moe_stats.end_moe_step's record


def train_step(state: TrainState, microbatches: list[torch.Tensor], lr,
               stop_flags=None) -> StepResult:
    """One training step at learning rate `lr` (a float, or (lr, decoupled lr)). `stop_flags()`
    (called after the optimizer step) gives this rank's stop conditions (e.g. the wall clock is past
    --exit-duration-in-mins, a signal came), agreed over the whole layout in the loss's reduction
    (`_global_loss`)."""
    par = state.cfg.parallel
    schedule = get_schedule(par.schedule, state.groups.topology.pp, par.virtual_stages)
    state.engine.begin_step()
    moe = state.cfg.model.num_experts > 0
    if moe:
        begin_moe_step(state.chunks, len(microbatches), state.groups.topology.dp, state.engine.loss_scaler.scale)
    result = schedule(_job(state, microbatches, state.phase_timers), forward_only=False)
    with _Timed(state.phase_timers, "reduce"):
        state.engine.finish_gradients()
        finalize_model_grads(state.engine.parameters(), state.engine.grad_pieces, state.groups)
    run = state.cfg.run
    if run.empty_unused_memory_level >= 1:
        empty_cache(state.device)
    zeros = state.engine.counted_stats("grad")[1] if run.log_num_zeros_in_grad else None
    with _Timed(state.phase_timers, "step"):
        stats = state.engine.step(lr)
    state.iteration += 1
    moe_record = end_moe_step(state.chunks, state.groups, state.cfg.model, len(microbatches),
                              par.sequence_parallel, state.device) if moe else None
    loss, agreed = _global_loss(state, result.losses, stop_flags() if stop_flags is not None else ())
    state.groups.log.end_step()
    if run.empty_unused_memory_level >= 2:
        empty_cache(state.device)
    return StepResult(loss, stats.grad_norm, stats.skipped, stats.loss_scale, result.max_in_flight, agreed,
                      zeros, moe_record)


def empty_cache(device: torch.device) -> None:
    """Gives the caching allocator's unused blocks back to the device (--empty-unused-memory-level)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


@torch.no_grad()
def evaluate(state: TrainState, batches: list[list[torch.Tensor]]) -> float:
    """Mean token loss over the given global batches (forward only)."""
    par = state.cfg.parallel
    schedule = get_schedule(par.schedule, state.groups.topology.pp, par.virtual_stages)
    for chunk in state.chunks:
        chunk.eval()
    total = 0.0
    for microbatches in batches:
        total += _global_loss(state, schedule(_job(state, microbatches), forward_only=True).losses)[0]
    for chunk in state.chunks:
        chunk.train()
    state.groups.log.end_step()        # evaluation traffic is not the next training step's
    return total / max(1, len(batches))


def peak_memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def train(state: TrainState, train_source: MicrobatchSource, valid_batches, lr_at, metrics=None,
          start_iteration: int = 0, policy=None) -> list[dict]:
    """Runs steps start_iteration+1 .. cfg.train_iters; returns one record per step (and per
    evaluation). `lr_at(n, done_samples)` is the rate(s) of the n-th applied optimizer step, after
    applied steps that consumed `done_samples` samples (megazero.training.lr_schedule.step_learning_rate).
    `policy` (megazero.checkpoint.SavePolicy) saves when due and may stop early."""
    cfg = state.cfg
    history, window = [], []
    par = cfg.parallel
    chunk_layers = [len(r) for r in stage_layer_ranges(cfg.model.num_layers, par.pipeline_parallel,
                                                       par.virtual_stages, par.layer_split)]
    peak = peak_tflops(state.device)
    world = state.groups.topology.world_size
    housekeeping = Housekeeping(cfg.run, state.groups.rank, state.device, cfg.run_dir)
    consumed = cfg.consumed_before(start_iteration)
    # The schedule counts applied optimizer steps (Megatron's scheduler does not advance on a skipped
    # step; a checkpoint loaded without its optimizer restarts it), and in samples their samples.
    applied = cfg.consumed_before(state.engine.step_count)
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
            record = {"iteration": it + 1, "loss": step.loss, "lr": lr, "grad_norm": step.grad_norm,
                      "skipped": step.skipped, "loss_scale": step.loss_scale,
                      "tokens_per_s": tokens_per_step / elapsed, "ms_per_iter": 1000 * elapsed,
                      "tflops_per_device": flops_per_step / elapsed / world / 1e12,
                      "memory_mib": peak_memory_mib(state.device),
                      "skipped_total": state.engine.skipped_steps}
            record.update(_optional_fields(state, rates, batch, consumed, step))
            if step.moe is not None:
                record.update(moe_aux_loss=step.moe["aux"], moe_z_loss=step.moe["z"],
                              moe_dropped=step.moe["dropped"],
                              moe_load={str(i): list(v) for i, v in step.moe["load"].items()})
            if peak is not None:       # model FLOPs (MFU) and with recomputation (hardware FLOPs, HFU)
                record["mfu"] = record["tflops_per_device"] / peak
                record["hfu"] = hardware_flops / elapsed / world / 1e12 / peak
            if state.timers is not None:
                record["time_ms"] = state.timers.elapsed_ms()
            if step.skipped and metrics is not None:
                metrics.say(f" iteration {it + 1}: non-finite gradient norm ({step.grad_norm}), step skipped "
                            f"(loss scale {step.loss_scale:g}; {state.engine.skipped_steps} skipped so far)")
            history.append(record)
            window.append(record)
            if state.stragglers is not None:
                _watch_stragglers(state, record, (it + 1) % cfg.log_interval == 0, it == start_iteration)
            if metrics is not None and ((it + 1) % cfg.log_interval == 0 or it == start_iteration):
                metrics.log_train(window, state.groups.log)
                window = []
            last = it + 1 == cfg.train_iters
            if valid_batches and ((it + 1) % cfg.eval_interval == 0 or last):
                housekeeping.around_evaluation()
                eval_record = {"iteration": it + 1, "split": "valid", "loss": evaluate(state, valid_batches)}
                housekeeping.around_evaluation()
                history.append(eval_record)
                if metrics is not None:
                    metrics.log_eval(eval_record)
            housekeeping.after_step(it + 1)
            stop = policy.after_step(state, consumed, step.stop_flags) if policy else None
            if stop:
                if metrics is not None:
                    metrics.say(f" stopping after iteration {it + 1} ({stop})")
                break
    finally:
        housekeeping.close()
    if policy is not None:
        policy.finish(state, consumed)
    return history


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
