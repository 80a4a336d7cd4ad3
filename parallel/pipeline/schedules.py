"""Pipeline schedules, all with one signature behind `get_schedule`:

    schedule(job: PipelineJob, forward_only: bool) -> ScheduleResult

  no pipelining   one stage: forward and backward each microbatch in turn (gradient accumulation)
  GPipe           all forwards, then all backwards (Huang et al. 2019): every microbatch's
                  activations are held at once
  1F1B            warmup forwards, then one-forward-one-backward, then cooldown backwards
                  (PipeDream-Flush, Narayanan et al. 2021): at most pp microbatches in flight
  interleaved     1F1B over v model chunks per stage (Narayanan et al. 2021, SC'21), shrinking the
                  bubble by v at the cost of v times the point-to-point traffic

The job carries the model-specific steps; the schedules only order them and move tensors. Each
`p2p.exchange` call is one batch, and messages carry no tags: the order of the calls on neighbouring
stages is what matches a send with its receive (the rule is in p2p.py; tests/test_p2p_order.py
checks every schedule against it).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from .p2p import PipelineP2P, backward_from_freed, free_output


@dataclasses.dataclass
class PipelineJob:
    num_microbatches: int
    num_chunks: int                      # model chunks on this stage (virtual stages)
    stage: int
    num_stages: int
    # forward(chunk, input or None, microbatch) -> hidden states, or the loss on the last chunk
    forward: Callable[[int, torch.Tensor | None, int], torch.Tensor]
    # backward(output or loss, output grad or None, last backward of the step) -> None
    backward: Callable[[torch.Tensor, torch.Tensor | None, bool], None]
    p2p: PipelineP2P | None = None

    def is_loss_chunk(self, chunk: int) -> bool:
        return self.stage == self.num_stages - 1 and chunk == self.num_chunks - 1

    def is_input_chunk(self, chunk: int) -> bool:
        return self.stage == 0 and chunk == 0


@dataclasses.dataclass
class ScheduleResult:
    losses: list[torch.Tensor]           # per microbatch, on the stage that computes the loss
    max_in_flight: int                   # most microbatches whose activations were held at once


class _Runner:
    """Bookkeeping shared by the schedules: in-flight activations, losses, backward calls."""

    def __init__(self, job: PipelineJob, forward_only: bool):
        self.job, self.forward_only = job, forward_only
        self.inputs = [[] for _ in range(job.num_chunks)]
        self.outputs = [[] for _ in range(job.num_chunks)]
        self.grads = [[] for _ in range(job.num_chunks)]
        self.losses, self.in_flight, self.max_in_flight = [], 0, 0
        self.backwards_left = 0 if forward_only else job.num_microbatches * job.num_chunks

    def forward(self, chunk: int, microbatch: int, input_tensor=None) -> torch.Tensor | None:
        out = self.job.forward(chunk, input_tensor, microbatch)
        if self.job.is_loss_chunk(chunk):
            self.losses.append(out.detach())
        if not self.forward_only:
            self.inputs[chunk].append(input_tensor)
            self.outputs[chunk].append(out)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        return None if self.job.is_loss_chunk(chunk) else out

    def backward(self, chunk: int, output_grad=None) -> torch.Tensor | None:
        input_tensor = self.inputs[chunk].pop(0)
        output = self.outputs[chunk].pop(0)
        self.backwards_left -= 1
        self.job.backward(output, output_grad, self.backwards_left == 0)
        self.in_flight -= 1
        return None if input_tensor is None else input_tensor.grad


def run_no_pipelining(job: PipelineJob, forward_only: bool = False) -> ScheduleResult:
    run = _Runner(job, forward_only)
    for mb in range(job.num_microbatches):
        run.forward(0, mb)
        if not forward_only:
            run.backward(0)
    return ScheduleResult(run.losses, run.max_in_flight)


def run_gpipe(job: PipelineJob, forward_only: bool = False) -> ScheduleResult:
    run, p2p = _Runner(job, forward_only), job.p2p
    first, last = job.stage == 0, job.stage == job.num_stages - 1
    for mb in range(job.num_microbatches):
        x, _ = p2p.exchange(recv_forward=not first)
        out = run.forward(0, mb, x)
        p2p.exchange(send_forward=out)
        free_output(out)
    if not forward_only:
        for mb in range(job.num_microbatches):
            _, grad = p2p.exchange(recv_backward=not last)
            p2p.exchange(send_backward=run.backward(0, grad))
    return ScheduleResult(run.losses, run.max_in_flight)


def run_1f1b(job: PipelineJob, forward_only: bool = False) -> ScheduleResult:
    run, p2p = _Runner(job, forward_only), job.p2p
    first, last = job.stage == 0, job.stage == job.num_stages - 1
    m = job.num_microbatches
    warmup = m if forward_only else min(job.num_stages - job.stage - 1, m)
    steady = m - warmup

    for mb in range(warmup):                                   # warmup: forwards only
        x, _ = p2p.exchange(recv_forward=not first)
        out = run.forward(0, mb, x)
        p2p.exchange(send_forward=out)
        free_output(out)

    x = p2p.exchange(recv_forward=not first)[0] if steady else None
    for i in range(steady):                                    # steady: one forward, one backward
        out = run.forward(0, warmup + i, x)
        _, grad = p2p.exchange(send_forward=out, recv_backward=not last)
        free_output(out)
        input_grad = run.backward(0, grad)
        more = i < steady - 1
        x, _ = p2p.exchange(send_backward=input_grad, recv_forward=more and not first)

    if not forward_only:
        for _ in range(warmup):                                # cooldown: backwards only
            _, grad = p2p.exchange(recv_backward=not last)
            p2p.exchange(send_backward=run.backward(0, grad))
    return ScheduleResult(run.losses, run.max_in_flight)


def run_interleaved(job: PipelineJob, forward_only: bool = False) -> ScheduleResult:
    """Interleaved 1F1B: virtual microbatch k runs chunk (k // pp) % v (backwards in reverse chunk
    order) on microbatch (k // (pp*v)) * pp + k % pp."""
    run, p2p = _Runner(job, forward_only), job.p2p
    pp, v, m = job.num_stages, job.num_chunks, job.num_microbatches
    total = m * v

    def chunk_of(k: int, forward: bool) -> int:
        c = (k % (pp * v)) // pp
        return c if forward else v - 1 - c

    def microbatch_of(k: int) -> int:
        return (k // (pp * v)) * pp + k % pp

    if forward_only or m == pp:
        warmup = total
    else:
        warmup = min((pp - job.stage - 1) * 2 + (v - 1) * pp, total)
    steady = total - warmup

    def wants_input(k: int) -> bool:          # does forward k receive from the previous stage?
        return k < total and not job.is_input_chunk(chunk_of(k, True))

    def wants_grad(k: int) -> bool:           # does backward k receive from the next stage?
        return k < total and not job.is_loss_chunk(chunk_of(k, False))

    def forward_k(k: int):
        c = chunk_of(k, True)
        x = run.inputs_pending[c].pop(0) if run.inputs_pending[c] else None
        return run.forward(c, microbatch_of(k), x)

    run.inputs_pending = [[] for _ in range(v)]
    first_input, _ = p2p.exchange(recv_forward=wants_input(0))
    run.inputs_pending[0].append(first_input)
    for k in range(warmup):
        out = forward_k(k)
        # The last warmup exchange also fetches the output gradient of the first backward.
        get_grad = k == warmup - 1 and not forward_only and wants_grad(0)
        x, grad = p2p.exchange(send_forward=out, recv_forward=wants_input(k + 1), recv_backward=get_grad)
        free_output(out)
        if x is not None:
            run.inputs_pending[chunk_of(k + 1, True)].append(x)
        if grad is not None:
            run.grads[chunk_of(0, False)].append(grad)

    for i in range(steady):
        fk, bk = warmup + i, i
        out = forward_k(fk)
        c = chunk_of(bk, False)
        input_grad = run.backward(c, run.grads[c].pop(0) if run.grads[c] else None)
        x, grad = p2p.exchange(send_forward=out, send_backward=input_grad,
                               recv_forward=wants_input(fk + 1), recv_backward=wants_grad(bk + 1))
        free_output(out)
        if x is not None:
            run.inputs_pending[chunk_of(fk + 1, True)].append(x)
        if grad is not None:
            run.grads[chunk_of(bk + 1, False)].append(grad)

    if not forward_only:
        for bk in range(steady, total):
            c = chunk_of(bk, False)
            input_grad = run.backward(c, run.grads[c].pop(0) if run.grads[c] else None)
            _, grad = p2p.exchange(send_backward=input_grad, recv_backward=wants_grad(bk + 1))
            if grad is not None:
                run.grads[chunk_of(bk + 1, False)].append(grad)
    return ScheduleResult(run.losses, run.max_in_flight)


def get_schedule(name: str, num_stages: int, num_chunks: int):
    """The schedule function for a run; 'auto' picks no-pipelining, 1F1B or interleaved."""
    if name == "auto":
        name = "none" if num_stages == 1 else "interleaved" if num_chunks > 1 else "1f1b"
    schedules = {"none": run_no_pipelining, "gpipe": run_gpipe, "1f1b": run_1f1b,
                 "interleaved": run_interleaved}
    return schedules[name]


def make_backward(engine_backward):
    """Adapts the ZeRO engine's backward to the schedules: the loss chunk backpropagates its loss,
    the others their (possibly freed) output with the gradient received from the next stage."""

    def backward(output: torch.Tensor, output_grad: torch.Tensor | None, last: bool) -> None:
        if output_grad is None:
            engine_backward(output, last_microbatch=last)
        else:
            engine_backward(lambda: backward_from_freed([output], [output_grad]), last_microbatch=last)

    return backward
