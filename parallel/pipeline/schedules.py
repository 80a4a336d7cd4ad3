"""Pipeline schedules, all with one signature behind `get_schedule`:

    schedule(job: PipelineJob, forward_only: bool) -> ScheduleResult

  no pipelining   one stage: forward and backward each microbatch in turn (gradient accumulation)
  GPipe           all forwards, then all backwards (Huang et al. 2019): every microbatch's
                  activations are held at once
  1F1B            warmup forwards, then one-forward-one-backward, then cooldown backwards
                  (PipeDream-Flush, Narayanan et al. 2021): at most pp microbatches in flight
  interleaved     1F1B over v model chunks per stage (Narayanan et al. 2021, SC'21), shrinking the
                  bubble by v at the cost of v times the point-to-point traffic
  zb-h1, zbv, interleaved-zb, dualpipev
                  the zero-bubble schedules: each backward split into B (input gradient) and W
                  (weight gradient, deferred to fill the bubble); written as lists of actions per
                  rank (zero_bubble.py) and run by action_runner.py

The job carries the model-specific steps; the schedules only order them and move tensors. Each
`p2p.exchange` call is one batch, and messages carry no tags: the order of the calls on neighbouring
stages is what matches a send with its receive (the rule is in p2p.py;
tests/parallel/pipeline/test_p2p_order.py checks every schedule against it).

With `job.overlap_p2p` (1F1B and interleaved; Megatron's overlap_p2p_comm) the batches are issued
with `p2p.start_exchange` and waited only when their tensors are needed, so transfers move while the
stage computes; each stage issues the same ops as without, in the same order per peer and
direction (which is all the matching sees), so the results are bitwise the same.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import torch

from .action_runner import run_list_schedule
from .p2p import PipelineP2P, backward_from_freed, free_output
from .zero_bubble import ZERO_BUBBLE_SCHEDULES, zero_bubble_schedule


@dataclasses.dataclass
class PipelineJob:
    num_microbatches: int
    num_chunks: int  # model chunks on this stage (virtual stages)
    stage: int
    num_stages: int
    # forward(chunk, input or None, microbatch) -> hidden states, or the loss on the last chunk
    forward: Callable[[int, torch.Tensor | None, int], torch.Tensor]
    # backward(output or loss, output grad or None, last backward of the step) -> None
    backward: Callable[[torch.Tensor, torch.Tensor | None, bool], None]
    p2p: PipelineP2P | None = None
    # 1F1B and interleaved: point-to-point batches stay in flight while the stage computes, waited
    # only when their tensors are needed (Megatron's overlap_p2p_comm); same ops, same order.
    overlap_p2p: bool = False
    # The zero-bubble schedules' split backward (models/split_backward.py, action_runner.py):
    # backward_input(output or loss, output grad or None, ticket) is B, which defers the weights'
    # gradients; backward_weight(run_w, ticket, last backward of the step) is W, which calls run_w.
    backward_input: Callable | None = None
    backward_weight: Callable | None = None

    def is_loss_chunk(self, chunk: int) -> bool:
        return self.stage == self.num_stages - 1 and chunk == self.num_chunks - 1

    def is_input_chunk(self, chunk: int) -> bool:
        return self.stage == 0 and chunk == 0


@dataclasses.dataclass
class ScheduleResult:
    losses: list[torch.Tensor]  # per microbatch, on the stage that computes the loss
    max_in_flight: int  # most microbatches whose activations were held at once
    max_deferred_w: int = 0  # most Bs whose W waited at once (zero-bubble schedules)


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
    if job.overlap_p2p:
        return _run_1f1b_overlapped(job, forward_only)
    run, p2p = _Runner(job, forward_only), job.p2p
    first, last = job.stage == 0, job.stage == job.num_stages - 1
    m = job.num_microbatches
    warmup = m if forward_only else min(job.num_stages - job.stage - 1, m)
    steady = m - warmup

    for mb in range(warmup):  # warmup: forwards only
        x, _ = p2p.exchange(recv_forward=not first)
        out = run.forward(0, mb, x)
        p2p.exchange(send_forward=out)
        free_output(out)

    x = p2p.exchange(recv_forward=not first)[0] if steady else None
    for i in range(steady):  # steady: one forward, one backward
        out = run.forward(0, warmup + i, x)
        _, grad = p2p.exchange(send_forward=out, recv_backward=not last)
        free_output(out)
        input_grad = run.backward(0, grad)
        more = i < steady - 1
        x, _ = p2p.exchange(send_backward=input_grad, recv_forward=more and not first)

    if not forward_only:
        for _ in range(warmup):  # cooldown: backwards only
            _, grad = p2p.exchange(recv_backward=not last)
            p2p.exchange(send_backward=run.backward(0, grad))
    return ScheduleResult(run.losses, run.max_in_flight)


def _run_1f1b_overlapped(job: PipelineJob, forward_only: bool) -> ScheduleResult:
    """1F1B whose transfers move while the stage computes: the next forward's input is asked for
    before the backward runs (it arrives during it), and the input gradient leaves without waiting
    (it travels during the next forward). Each batch is waited just before its tensors are used.
    The output gradient is still asked for with the output (one batch, as without overlap): asked
    for ahead of that send, a stage's stream would wait for it before sending what the next stage
    needs to produce it."""
    run, p2p = _Runner(job, forward_only), job.p2p
    first, last = job.stage == 0, job.stage == job.num_stages - 1
    m = job.num_microbatches
    warmup = m if forward_only else min(job.num_stages - job.stage - 1, m)
    steady = m - warmup
    inputs = p2p.start_exchange(recv_forward=not first)  # brings the next forward's input
    grads = None  # brings the next backward's gradient
    for mb in range(warmup):
        x, _ = inputs.wait()
        out = run.forward(0, mb, x)
        inputs = p2p.start_exchange(send_forward=out, recv_forward=mb + 1 < m and not first)
        free_output(out)
    if not forward_only and steady == 0:
        grads = p2p.start_exchange(recv_backward=not last)
    sent = None  # the last input gradient, on its way
    for i in range(steady):
        x, _ = inputs.wait()
        out = run.forward(0, warmup + i, x)
        grads = p2p.start_exchange(send_forward=out, recv_backward=not last)
        inputs = p2p.start_exchange(recv_forward=warmup + i + 1 < m and not first)
        free_output(out)
        _, grad = grads.wait()
        input_grad = run.backward(0, grad)
        if sent is not None:
            sent.wait()
        cooldown_next = i == steady - 1 and steady < m and not last
        sent = grads = p2p.start_exchange(send_backward=input_grad, recv_backward=cooldown_next)
    for b in range(steady, 0 if forward_only else m):
        _, grad = grads.wait()
        grads = p2p.start_exchange(send_backward=run.backward(0, grad), recv_backward=b + 1 < m and not last)
    for pending in (inputs, grads):
        if pending is not None:
            pending.wait()
    return ScheduleResult(run.losses, run.max_in_flight)


class _Interleaving:
    """The interleaved schedule's order: virtual microbatch k runs chunk (k // pp) % v (backwards in
    reverse chunk order) on microbatch (k // (pp*v)) * pp + k % pp; `warmup` forwards run before
    the first backward."""

    def __init__(self, job: PipelineJob, forward_only: bool):
        self.job, self.pp, self.v = job, job.num_stages, job.num_chunks
        self.total = job.num_microbatches * self.v
        if forward_only or job.num_microbatches == self.pp:
            self.warmup = self.total
        else:
            self.warmup = min((self.pp - job.stage - 1) * 2 + (self.v - 1) * self.pp, self.total)

    def chunk_of(self, k: int, forward: bool) -> int:
        c = (k % (self.pp * self.v)) // self.pp
        return c if forward else self.v - 1 - c

    def microbatch_of(self, k: int) -> int:
        return (k // (self.pp * self.v)) * self.pp + k % self.pp

    def wants_input(self, k: int) -> bool:  # does forward k receive from the previous stage?
        return k < self.total and not self.job.is_input_chunk(self.chunk_of(k, True))

    def wants_grad(self, k: int) -> bool:  # does backward k receive from the next stage?
        return k < self.total and not self.job.is_loss_chunk(self.chunk_of(k, False))


class _InterleavedRunner(_Runner):
    """_Runner plus the interleaved schedule's queues of received inputs and gradients per chunk."""

    def __init__(self, job: PipelineJob, forward_only: bool):
        super().__init__(job, forward_only)
        self.order = _Interleaving(job, forward_only)
        self.inputs_pending = [[] for _ in range(job.num_chunks)]

    def forward_k(self, k: int) -> torch.Tensor | None:
        c = self.order.chunk_of(k, True)
        x = self.inputs_pending[c].pop(0) if self.inputs_pending[c] else None
        return self.forward(c, self.order.microbatch_of(k), x)

    def backward_k(self, k: int) -> torch.Tensor | None:
        c = self.order.chunk_of(k, False)
        return self.backward(c, self.grads[c].pop(0) if self.grads[c] else None)

    def received(self, x, grad, forward_k: int, backward_k: int) -> None:
        """Queues an input that arrived for forward `forward_k` and a gradient for `backward_k`."""
        if x is not None:
            self.inputs_pending[self.order.chunk_of(forward_k, True)].append(x)
        if grad is not None:
            self.grads[self.order.chunk_of(backward_k, False)].append(grad)


def run_interleaved(job: PipelineJob, forward_only: bool = False) -> ScheduleResult:
    """Interleaved 1F1B over the job's model chunks (see _Interleaving for the order)."""
    if job.overlap_p2p:
        return _run_interleaved_overlapped(job, forward_only)
    run, p2p = _InterleavedRunner(job, forward_only), job.p2p
    order = run.order
    total, warmup = order.total, order.warmup
    first_input, _ = p2p.exchange(recv_forward=order.wants_input(0))
    run.received(first_input, None, 0, 0)
    for k in range(warmup):
        out = run.forward_k(k)
        # The last warmup exchange also fetches the output gradient of the first backward.
        get_grad = k == warmup - 1 and not forward_only and order.wants_grad(0)
        x, grad = p2p.exchange(send_forward=out, recv_forward=order.wants_input(k + 1), recv_backward=get_grad)
        free_output(out)
        run.received(x, grad, k + 1, 0)

    for i in range(total - warmup):
        fk, bk = warmup + i, i
        out = run.forward_k(fk)
        input_grad = run.backward_k(bk)
        x, grad = p2p.exchange(
            send_forward=out,
            send_backward=input_grad,
            recv_forward=order.wants_input(fk + 1),
            recv_backward=order.wants_grad(bk + 1),
        )
        free_output(out)
        run.received(x, grad, fk + 1, bk + 1)

    if not forward_only:
        for bk in range(total - warmup, total):
            input_grad = run.backward_k(bk)
            _, grad = p2p.exchange(send_backward=input_grad, recv_backward=order.wants_grad(bk + 1))
            run.received(None, grad, 0, bk + 1)
    return ScheduleResult(run.losses, run.max_in_flight)


def _run_interleaved_overlapped(job: PipelineJob, forward_only: bool) -> ScheduleResult:
    """Interleaved 1F1B whose sends and receives move during compute: the combined exchange of each
    steady step is split into a forward batch, issued after the forward and in flight during the
    backward, and a backward batch, issued after the backward and in flight during the next
    forward (activations before gradients still, so each stage's op order is the same)."""
    run, p2p = _InterleavedRunner(job, forward_only), job.p2p
    order = run.order
    total, warmup = order.total, order.warmup
    forwards = p2p.start_exchange(recv_forward=order.wants_input(0))
    backwards = None

    def forward(k: int) -> None:
        nonlocal forwards
        x, _ = forwards.wait()
        run.received(x, None, k, 0)
        out = run.forward_k(k)
        forwards = p2p.start_exchange(send_forward=out, recv_forward=order.wants_input(k + 1))
        free_output(out)

    def backward(k: int) -> None:
        nonlocal backwards
        _, grad = backwards.wait()
        run.received(None, grad, 0, k)
        backwards = p2p.start_exchange(send_backward=run.backward_k(k), recv_backward=order.wants_grad(k + 1))

    for k in range(warmup):
        forward(k)
    if not forward_only:
        backwards = p2p.start_exchange(recv_backward=order.wants_grad(0))
        for i in range(total - warmup):
            forward(warmup + i)
            backward(i)
        for k in range(total - warmup, total):
            backward(k)
        backwards.wait()
    forwards.wait()
    return ScheduleResult(run.losses, run.max_in_flight)


def get_schedule(name: str, num_stages: int, num_chunks: int, microbatches: int | None = None):
    """The schedule function for a run; 'auto' picks no-pipelining, 1F1B or interleaved. The
    zero-bubble schedules (zero_bubble.py) are lists of actions per rank, made for `microbatches`
    (the step's count; evaluation runs their forwards)."""
    if name == "auto":
        name = "none" if num_stages == 1 else "interleaved" if num_chunks > 1 else "1f1b"
    if name in ZERO_BUBBLE_SCHEDULES:
        return functools.partial(
            run_zero_bubble, schedule=zero_bubble_schedule(name, num_stages, num_chunks, microbatches)
        )
    schedules = {"none": run_no_pipelining, "gpipe": run_gpipe, "1f1b": run_1f1b, "interleaved": run_interleaved}
    return schedules[name]


def run_zero_bubble(job: PipelineJob, forward_only: bool = False, *, schedule) -> ScheduleResult:
    """A zero-bubble schedule's lists of actions (zero_bubble.py), run by action_runner.py."""
    return ScheduleResult(*run_list_schedule(job, schedule, forward_only))


def make_split_backward(engine_backward_input, engine_backward_weight):
    """(backward_input, backward_weight) of a PipelineJob from the ZeRO engine's split backward:
    B from the loss, or from the (possibly freed) output with its gradient; W as the engine runs it."""

    def backward_input(output: torch.Tensor, output_grad: torch.Tensor | None, ticket) -> None:
        if output_grad is None:
            engine_backward_input(output, ticket)
        else:
            engine_backward_input(lambda: backward_from_freed([output], [output_grad]), ticket)

    def backward_weight(run_w, ticket, last: bool) -> None:
        engine_backward_weight(run_w, ticket, last_microbatch=last)

    return backward_input, backward_weight


def make_backward(engine_backward):
    """Adapts the ZeRO engine's backward to the schedules: the loss chunk backpropagates its loss,
    the others their (possibly freed) output with the gradient received from the next stage."""

    def backward(output: torch.Tensor, output_grad: torch.Tensor | None, last: bool) -> None:
        if output_grad is None:
            engine_backward(output, last_microbatch=last)
        else:
            engine_backward(lambda: backward_from_freed([output], [output_grad]), last_microbatch=last)

    return backward
