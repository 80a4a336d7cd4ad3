"""Pipeline bubble of our schedules (GPipe, 1F1B, interleaved 1F1B and the zero-bubble ones: zb-h1,
zbv, interleaved-zb, dualpipev) against the theoretical bubble.

Definition (used for both columns): the bubble is the fraction of a step's wall time a stage is not
computing,
    bubble = 1 - busy / step_time
and the theory (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", section 2.2) gives, with p stages, m microbatches and v model chunks per
stage (v = 1 for GPipe and 1F1B),
    step_time = (m + (p - 1) / v) * (t_f + t_b)      ->      bubble = (p - 1) / (v * m + p - 1)
(the paper's "bubble time fraction" (p - 1) / (v m) is the same idle time relative to the ideal
m (t_f + t_b) instead of relative to the whole step).

Method: the real schedules (`megazero.parallel.pipeline.schedules`) drive a `PipelineJob` whose
forward and backward steps sleep for known times (forward t_f, backward t_b = 2 t_f per microbatch
and stage; with v chunks each chunk sleeps 1/v of that, so every stage computes m (t_f + t_b) per
step whatever the schedule) and pass a small activation tensor through the real `PipelineP2P` over
gloo. Sleeping rather than computing lets 4 ranks share 2 cores without stealing each other's time,
so what is measured is the schedule's ordering and the p2p latency, not CPU contention.
  step_time  wall time of `schedule(job)` after a barrier, slowest rank, median of the timed steps
  busy       time inside the forward/backward steps on a rank (the sleeps as they really ran),
             mean over ranks
Ratio = measured / theoretical bubble (1.0: the schedule idles exactly as the theory says). The
theory leaves out the exchanges' latency; "excess ms" is the step time beyond the theory's, and a
ping-pong between two stages is printed first to size one exchange. (Rerun with a larger
--t-forward-ms: an excess that stays the same in ms is latency, one that grows is the ordering.)

The zero-bubble schedules split each backward into B and W (parallel/pipeline/zero_bubble.py): their
job sleeps t_f for B and t_f for W (the paper's T_F = T_B = T_W, the same 2 t_f of backward per
microbatch), and their theory is the idle fraction of the schedule's own list of actions on an ideal
machine (`simulate`, actions.py), which for 1F1B and ZB-H1 is the closed form
(p - 1) / (m + p - 1) and (p - 1) / (3 m + p - 1). The last table sets each zero-bubble schedule's
measured bubble beside 1F1B's at the same point.

--work compute replaces the sleeps by a compute-bound layer (float32 matmuls of a fixed size, as many
as took the asked time when calibrated alone): a real CPU load, meaningful only where every rank has
a core of its own (4 ranks: 4 free cores); on a shared machine the ranks steal each other's time.

1F1B and interleaved also run with overlapped p2p (`PipelineJob.overlap_p2p`, the
--overlap-p2p-communication flag): the same schedule whose transfers move during the sleeps. A second
table gives, per point, the overlapped step time over the plain one (below 1: latency hidden) and
both bubbles against the theory.

    python bench/bench_pipeline_bubble.py                  # ~3 min on 2 cores (t_f = 20 ms)
    python bench/bench_pipeline_bubble.py --pp 4 --schedules 1f1b,zb-h1,zbv,interleaved-zb,dualpipev
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from megazero.core.comm import barrier
from megazero.parallel.pipeline.p2p import PipelineP2P, backward_from_freed
from megazero.parallel.pipeline.actions import simulate
from megazero.parallel.pipeline.schedules import PipelineJob, get_schedule, make_backward
from megazero.parallel.pipeline.zero_bubble import V_SHAPED, ZERO_BUBBLE_SCHEDULES, check_shape, zero_bubble_schedule
from megazero.parallel.topology import Topology
from megazero.testing import DistributedPool

# schedule -> model chunks per stage
SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved": 2, "zb-h1": 1, "zbv": 2, "interleaved-zb": 2, "dualpipev": 2}
SEQ = 16  # activation (1, SEQ, hidden), fp32


def activation_shape(kib: int) -> tuple[int, int, int]:
    return (1, SEQ, max(1, kib * 1024 // (4 * SEQ)))


def theoretical_bubble(schedule: str, pp: int, m: int, v: int) -> float:
    if schedule in ZERO_BUBBLE_SCHEDULES:
        return simulate(zero_bubble_schedule(schedule, pp, v, m)).idle_fraction()
    return (pp - 1) / (v * m + pp - 1)


def spin(seconds: float, work) -> None:
    """Sleeps, or runs the compute-bound layer's matmuls (`work`: (a, repeats per second))."""
    if work is None:
        time.sleep(seconds)
        return
    a, rate = work
    for _ in range(max(1, round(seconds * rate))):
        torch.mm(a, a)


def calibrate(size: int = 256) -> tuple[torch.Tensor, float]:
    """The compute-bound layer: a size x size float32 matmul, and how many run per second here."""
    a = torch.randn(size, size) / size**0.5
    for _ in range(20):
        torch.mm(a, a)
    started, n = time.perf_counter(), 200
    for _ in range(n):
        torch.mm(a, a)
    return a, n / (time.perf_counter() - started)


class SleepJob:
    """The model-specific steps of a PipelineJob, replaced by sleeps of known length. The forward
    keeps a one-op autograd graph from its input so the schedules' backward path (gradient sent to
    the previous stage) runs for real."""

    def __init__(self, t_forward: float, t_backward: float, is_loss_chunk, shape, work=None):
        self.t_forward, self.t_backward, self.is_loss_chunk = t_forward, t_backward, is_loss_chunk
        self.work = work
        self.busy = 0.0
        self.source = torch.ones(shape, requires_grad=True)  # the first stage's input

    def forward(self, chunk: int, input_tensor, microbatch: int) -> torch.Tensor:
        started = time.perf_counter()
        spin(self.t_forward, self.work)
        x = self.source if input_tensor is None else input_tensor
        out = x * 1.0
        self.busy += time.perf_counter() - started
        return out.sum() if self.is_loss_chunk(chunk) else out

    def backward(self, loss, last_microbatch: bool = True) -> None:
        started = time.perf_counter()
        spin(self.t_backward, self.work)
        loss() if callable(loss) else loss.backward()
        self.busy += time.perf_counter() - started

    def backward_input(self, output, output_grad, ticket) -> None:
        """B of a split backward: half the backward's time, and the input's gradient."""
        started = time.perf_counter()
        spin(self.t_backward / 2, self.work)
        output.backward() if output_grad is None else backward_from_freed([output], [output_grad])
        self.busy += time.perf_counter() - started

    def backward_weight(self, run_w, ticket, last: bool) -> None:
        """W: the other half (the sleeper has no weights; run_w hands over nothing)."""
        started = time.perf_counter()
        spin(self.t_backward / 2, self.work)
        run_w()
        self.busy += time.perf_counter() - started


def measure(
    ctx, schedule: str, pp: int, m: int, t_forward: float, steps: int, overlap: bool, kib: int, compute: bool = False
) -> dict | None:
    """One (schedule, pp, m) point on this rank; ranks beyond pp return None."""
    groups = ctx.groups(Topology(world_size=pp, pp=pp))
    if groups is None:
        return None
    v, stage = SCHEDULES[schedule], groups.coords.pp
    shape = activation_shape(kib)
    loss_stage = 0 if schedule in V_SHAPED else pp - 1
    sleeper = SleepJob(
        t_forward / v,
        2 * t_forward / v,
        lambda chunk: stage == loss_stage and chunk == v - 1,
        shape,
        calibrate() if compute else None,
    )
    p2p = PipelineP2P(groups.pp, shape, torch.float32, torch.device("cpu"))
    job = PipelineJob(
        num_microbatches=m,
        num_chunks=v,
        stage=stage,
        num_stages=pp,
        forward=sleeper.forward,
        backward=make_backward(sleeper.backward),
        p2p=p2p,
        overlap_p2p=overlap,
        backward_input=sleeper.backward_input,
        backward_weight=sleeper.backward_weight,
    )
    run = get_schedule(schedule, pp, v, m)
    times, busy = [], []
    for step in range(steps + 1):  # the first step warms gloo's connections up
        barrier(groups.pp)
        sleeper.busy = 0.0
        started = time.perf_counter()
        run(job, forward_only=False)
        if step:
            times.append(time.perf_counter() - started)
            busy.append(sleeper.busy)
    return {"times": times, "busy": busy}


def point(
    pool: DistributedPool,
    schedule: str,
    pp: int,
    m: int,
    t_forward: float,
    steps: int,
    overlap: bool = False,
    kib: int = 2,
    compute: bool = False,
) -> dict:
    ranks = [r for r in pool.run(measure, schedule, pp, m, t_forward, steps, overlap, kib, compute) if r is not None]
    step_time = statistics.median(max(r["times"][i] for r in ranks) for i in range(steps))
    busy = statistics.mean(statistics.median(r["busy"]) for r in ranks)
    v = SCHEDULES[schedule]
    theory = theoretical_bubble(schedule, pp, m, v)
    return {
        "schedule": schedule + (" +ovl" if overlap else ""),
        "pp": pp,
        "m": m,
        "v": v,
        "plain": schedule,
        "overlap": overlap,
        "step_ms": 1000 * step_time,
        "busy_ms": 1000 * busy,
        "theory_step_ms": 1000 * busy / (1.0 - theory),
        "measured": 1.0 - busy / step_time,
        "theory": theory,
    }


def ping_pong(ctx, rounds: int, kib: int) -> float | None:
    """Median one-way time of an exchange between stages 0 and 1 (round trip / 2), in seconds."""
    groups = ctx.groups(Topology(world_size=2, pp=2))
    if groups is None:
        return None
    p2p = PipelineP2P(groups.pp, activation_shape(kib), torch.float32, torch.device("cpu"))
    x, times = torch.ones(activation_shape(kib)), []
    for _ in range(rounds):
        started = time.perf_counter()
        if groups.coords.pp == 0:
            p2p.exchange(send_forward=x)
            p2p.exchange(recv_backward=True)
        else:
            p2p.exchange(recv_forward=True)
            p2p.exchange(send_backward=x)
        times.append(time.perf_counter() - started)
    return statistics.median(times) / 2


def print_table(rows: list[dict]) -> None:
    head = (
        f"{'schedule':<17} {'pp':>2} {'m':>3} {'v':>2} {'busy ms':>8} {'step ms':>8} {'theory ms':>9} "
        f"{'excess ms':>9} {'bubble':>7} {'theory':>7} {'ratio':>6}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['schedule']:<17} {r['pp']:>2} {r['m']:>3} {r['v']:>2} {r['busy_ms']:>8.1f} "
            f"{r['step_ms']:>8.1f} {r['theory_step_ms']:>9.1f} {r['step_ms'] - r['theory_step_ms']:>9.1f} "
            f"{r['measured']:>7.3f} {r['theory']:>7.3f} {r['measured'] / r['theory']:>6.2f}"
        )
    print(
        "bubble = 1 - busy/step; theory = (pp-1)/(v*m + pp-1), or the zero-bubble list's ideal idle "
        "fraction; ratio = bubble/theory;\n"
        "theory ms = busy/(1 - theory), the step time the theory predicts from the measured compute; "
        "excess = step - theory ms; +ovl: overlapped p2p"
    )


def print_overlap_table(rows: list[dict]) -> None:
    plain = {(r["plain"], r["pp"], r["m"]): r for r in rows if not r["overlap"]}
    pairs = [
        (plain[(r["plain"], r["pp"], r["m"])], r)
        for r in rows
        if r["overlap"] and (r["plain"], r["pp"], r["m"]) in plain
    ]
    if not pairs:
        return
    head = (
        f"{'schedule':<12} {'pp':>2} {'m':>3} {'v':>2} {'plain ms':>8} {'ovl ms':>8} {'ovl/plain':>9} "
        f"{'excess':>7} {'ovl exc':>7} {'bubble/th':>9} {'ovl b/th':>8}"
    )
    print("\noverlapped p2p against plain, same points")
    print(head)
    print("-" * len(head))
    for a, b in pairs:
        print(
            f"{a['plain']:<12} {a['pp']:>2} {a['m']:>3} {a['v']:>2} {a['step_ms']:>8.1f} {b['step_ms']:>8.1f} "
            f"{b['step_ms'] / a['step_ms']:>9.3f} {a['step_ms'] - a['theory_step_ms']:>7.1f} "
            f"{b['step_ms'] - b['theory_step_ms']:>7.1f} {a['measured'] / a['theory']:>9.2f} "
            f"{b['measured'] / b['theory']:>8.2f}"
        )
    print("ovl/plain = overlapped step / plain step; excess = step - theory ms; b/th = bubble / theory")


def print_zero_bubble_table(rows: list[dict]) -> None:
    """Each zero-bubble schedule's measured bubble beside 1F1B's (plain p2p) at the same point."""
    base = {(r["pp"], r["m"]): r for r in rows if r["plain"] == "1f1b" and not r["overlap"]}
    pairs = [
        (base[(r["pp"], r["m"])], r) for r in rows if r["plain"] in ZERO_BUBBLE_SCHEDULES and (r["pp"], r["m"]) in base
    ]
    if not pairs:
        return
    head = (
        f"{'schedule':<15} {'pp':>2} {'m':>3} {'bubble':>7} {'theory':>7} {'1f1b':>7} {'1f1b th':>7} "
        f"{'/1f1b':>6} {'step/1f1b':>9}"
    )
    print("\nzero-bubble schedules against 1F1B, same points")
    print(head)
    print("-" * len(head))
    for a, b in pairs:
        print(
            f"{b['plain']:<15} {b['pp']:>2} {b['m']:>3} {b['measured']:>7.3f} {b['theory']:>7.3f} "
            f"{a['measured']:>7.3f} {a['theory']:>7.3f} {b['measured'] / a['measured']:>6.2f} "
            f"{b['step_ms'] / a['step_ms']:>9.3f}"
        )
    print("/1f1b = the schedule's measured bubble over 1F1B's; step/1f1b = its step time over 1F1B's")


def runs(schedule: str, pp: int, m: int) -> bool:
    """Whether the schedule takes this shape (dualpipev needs m >= 2 pp, interleaved-zb m % pp == 0)."""
    if schedule not in ZERO_BUBBLE_SCHEDULES:
        return schedule != "interleaved" or m % pp == 0
    try:
        check_shape(schedule, pp, SCHEDULES[schedule], m)
    except Exception:
        return False
    return True


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "--t-forward-ms",
        type=float,
        default=20.0,
        help="forward time per microbatch and stage; backward takes twice as long",
    )
    p.add_argument("--pp", default="2,4", help="pipeline sizes (at most 4 ranks are started)")
    p.add_argument("--microbatches", default="4,8,16")
    p.add_argument("--schedules", default=",".join(SCHEDULES))
    p.add_argument("--steps", type=int, default=3, help="timed steps per point (after one warm-up)")
    p.add_argument(
        "--activation-kib", type=int, default=2, help="size of each activation (and gradient) sent between stages"
    )
    p.add_argument(
        "--overlap",
        choices=["both", "off", "on"],
        default="both",
        help="1f1b/interleaved with plain p2p, overlapped p2p, or both (gpipe and the "
        "zero-bubble schedules: plain only)",
    )
    p.add_argument(
        "--work",
        choices=["sleep", "compute"],
        default="sleep",
        help="what a forward/backward does for its time: sleep, or a compute-bound matmul "
        "layer (needs a free core per rank)",
    )
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    pps = [int(x) for x in args.pp.split(",")]
    ms = [int(x) for x in args.microbatches.split(",")]
    t_forward = args.t_forward_ms / 1000
    print(
        f"t_f = {args.t_forward_ms:g} ms, t_b = {2 * args.t_forward_ms:g} ms per microbatch and stage "
        f"(split over v chunks; zero-bubble: B = W = t_f), {args.work}; gloo p2p on CPU, "
        f"{args.activation_kib} KiB activations; "
        f"{args.steps} timed steps per point; torch {torch.__version__}"
    )
    pool = DistributedPool(max(pps))
    rows = []
    try:
        latency = pool.run(ping_pong, 200, args.activation_kib)[0]
        print(f"one p2p exchange between two idle stages (ping-pong / 2): {1000 * latency:.2f} ms")
        modes = {"both": (False, True), "off": (False,), "on": (True,)}[args.overlap]
        for schedule in args.schedules.split(","):
            plain_only = schedule == "gpipe" or schedule in ZERO_BUBBLE_SCHEDULES
            for overlap in (False,) if plain_only else modes:
                for pp in pps:
                    for m in ms:
                        if runs(schedule, pp, m):
                            rows.append(
                                point(
                                    pool,
                                    schedule,
                                    pp,
                                    m,
                                    t_forward,
                                    args.steps,
                                    overlap,
                                    args.activation_kib,
                                    args.work == "compute",
                                )
                            )
    finally:
        pool.close()
    print_table(rows)
    print_overlap_table(rows)
    print_zero_bubble_table(rows)


if __name__ == "__main__":
    main()
