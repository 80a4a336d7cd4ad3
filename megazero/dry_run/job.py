"""The dry run: every rank of an N-GPU job, each in a process of its own on this CPU, running the
real recipe (megazero.run.pretrain: flags -> config -> process groups -> data -> model chunks -> ZeRO
engine -> training steps with the optimizer step -> a checkpoint save) with the `meta` device
standing in for its GPU and torch's fake process group for NCCL.

Meta tensors have shapes, dtypes and a device but no values: every kernel runs as shape arithmetic,
so a 70B model's step takes seconds and no memory of the model's size, and a tensor made on the host
meeting one fails exactly as it would meeting a CUDA tensor. The fake backend completes every
collective at once without moving anything; what each rank issued is recorded by its CommLog's trace
(megazero.core.comm.CommEntry) and compared across the members of every group afterwards
(megazero.dry_run.cross_rank_checks). Values the host reads back (the loss, the gradient norm, agreement
tables) come from megazero.core.host_read, which answers meta tensors with the value a healthy run
would agree on.

`run_rank` is the path itself, on any device and process group: the tests run it on gloo ranks of
the CPU to prove the dry run's traces equal a real run's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import sys
import tempfile
import traceback

import torch

from megazero.core import host_read
from megazero.core.comm import CommLog
from megazero.dry_run.gpu_kernels import device_kernels
from megazero.dry_run.device_stand_in import DeviceStandIn

DEFAULT_RANKS_PER_NODE = 8  # a GPU node's ranks, for the intra/inter-node split of the groups


@dataclasses.dataclass
class RankRun:
    """What one simulated rank did: its traced ops, host reads and (meta) memory; or its error."""

    rank: int
    coords: tuple | None = None
    entries: list = dataclasses.field(default_factory=list)
    step_ends: list = dataclasses.field(default_factory=list)  # len(entries) after each training step
    host_reads: list = dataclasses.field(default_factory=list)
    memory: dict | None = None
    model_states: dict | None = None  # the engine's own report (engine.memory.report()), bytes
    stream_check: dict | None = None  # the stream checker's counts and distinct violations
    skipped_steps: int | None = None  # optimizer steps skipped for a non-finite gradient norm
    trace: dict | None = None  # the op trace for the timeline (megazero.dry_run.trace)
    steady_state: dict | None = None  # how its step's microbatches were counted (steady_state.extend)
    requests: list | None = None  # the caching allocator's requests, in order (caching_allocator.replay)
    error: str | None = None  # one line: where a rank stopped (a misplaced tensor, a bug)
    detail: str | None = None  # its traceback


class SimulatedLaunch:
    """The recipe's RunEnvironment (megazero.run.pretrain) for one rank of a world simulated without a
    store: the flags read as on the simulated device's machine, meta for its device, its groups from
    `factory` over the fake process group, no memory check (what the simulated device holds is the
    dry run's finding), every rank preparing its own data (mock data writes no files)."""

    def __init__(self, rank: int, world: int, local_world: int, factory, cuda: bool, device="meta"):
        self.rank, self.world, self.local_world = rank, world, local_world
        self.factory, self.cuda_available, self._device = factory, cuda, torch.device(device)
        self.store = None

    def device(self, cfg):
        return self._device, ""  # the thread count is not this machine's to say

    def cpu_optimizer_threads(self) -> int:
        return 1

    def check_machine(self, cfg, device) -> None:
        from megazero.config.machine_checks import check_data, check_output_paths

        check_output_paths(cfg)
        check_data(cfg)

    def process_groups(self, cfg, device, log):
        from megazero.config.train_config import topology_of
        from megazero.parallel.process_groups import ProcessGroups

        return ProcessGroups.build(topology_of(cfg, self.world), self.rank, self.factory, log=log, device=device)

    def first(self, step: str):
        return lambda build: build(True)


def dry_argv(argv: list[str], workdir: str, save: bool = True) -> list[str]:
    """The user's flags, with what a dry run adds: mock data unless data is named (no file is read),
    outputs into `workdir`, no evaluation, and a save at the last step (its collectives are part of
    what ranks must agree on)."""
    argv = list(argv)
    if "--data-path" not in argv and "--mock-data" not in argv:
        argv.append("--mock-data")
    if "--run-dir" not in argv:
        argv += ["--run-dir", os.path.join(workdir, "run")]
    if "--eval-iters" not in argv:
        argv += ["--eval-iters", "0"]
    if save and "--save" not in argv:
        argv += ["--save", os.path.join(workdir, "checkpoints")]
    return argv


def run_rank(
    argv: list[str], world: int, rank: int, device, factory, local_world: int | None = None, cuda: bool = False
) -> RankRun | None:
    """Runs the recipe (megazero.run.pretrain: configure, then the run) for `rank` of `world` with
    `argv` (pretrain_gpt.py's flags) on `device` (meta, standing in for a GPU), its groups made by `factory` (a GroupFactory
    over an initialised default group); returns the rank's trace, or None for a process outside
    `world`. `cuda`: the flags are read as on a GPU machine (the default backend is nccl)."""
    from megazero.run import pretrain

    env = SimulatedLaunch(rank, world, local_world or min(world, DEFAULT_RANKS_PER_NODE), factory, cuda, device)
    recipe = pretrain.Pretraining(pretrain.configure(argv, env), env)
    log = CommLog(trace=True)
    groups = env.process_groups(recipe.cfg, recipe.device, log)
    if groups is None:
        return None
    run = RankRun(rank, coords=tuple(groups.coords))
    try:
        recipe.run(groups)
    except Exception as err:  # noqa: BLE001 - a rank's failure is a finding, reported per rank
        run.error = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        run.detail = traceback.format_exc()
    run.entries, run.step_ends = log.entries, log.step_ends
    if recipe.state is not None:
        run.model_states = {k: float(v) for k, v in recipe.state.engine.memory.report().items()}
        run.skipped_steps = recipe.state.engine.skipped_steps
    return run


def job_config(argv: list[str], world: int, local_world: int | None = None):
    """The TrainConfig of a `world`-rank GPU job of these flags (as each simulated rank reads them)."""
    from megazero.config.train_flags import config_from_args, parse_args

    return config_from_args(
        parse_args(dry_argv(argv, "/nonexistent")),
        world,
        local_world or min(world, DEFAULT_RANKS_PER_NODE),
        cuda_available=True,
    )


def check_flags(argv: list[str], world: int, local_world: int | None = None) -> str | None:
    """The flags' first mistake for a `world`-rank GPU job, as pretrain_gpt.py would say it."""
    from megazero.core.errors import UsageError

    try:
        job_config(argv, world, local_world)
    except UsageError as err:
        return str(err)
    return None


def planner_figures(argv: list[str], world: int, local_world: int | None) -> dict:
    """The memory planner's figures (megazero.config.memory_estimate.plan_bytes) for a GPU rank of
    this job (its largest stage): model states, activations, comm buffers on the device, their sum."""
    from megazero.config.memory_estimate import MODEL_STATE_KINDS, device_bytes, plan_bytes

    plan = plan_bytes(job_config(argv, world, local_world), world)
    return {
        "model_states": sum(plan[k] for k in MODEL_STATE_KINDS),
        "activations": plan["activations"],
        "comm_buffers": plan["comm_buffers"],
        "total": device_bytes(plan),
    }


def _simulated_rank(
    argv,
    world,
    rank,
    local_world,
    workdir,
    prepare=None,
    overflow_steps=(),
    streams=True,
    device_kind="cuda",
    save=True,
):
    """One simulated rank's process: the fake backend for NCCL, meta for the GPU (`device_kind`
    "cpu": for a CPU's kernels and memory, gloo's paths), the stream layer in its checking mode
    (megazero.core.stream_check, modelling meta as a device and the CPU as the host; violations
    collected, not raised). `prepare(rank)`, a context manager, is held open around the rank (the
    tests plant bugs with it); in `overflow_steps` (1-based training steps) the gradient norm reads
    inf, walking the step-skip path (with --no-check-for-nan-in-loss-and-grad, which would end the
    run there instead); `streams` False: no stream check; `save`: end with a checkpoint save's
    collectives."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from megazero.dry_run import trace
    from megazero.parallel.process_groups import GroupFactory

    torch.set_num_threads(1)
    # Batched p2p looks its backend up by the tensors' device type: register the fake one for meta.
    dist.init_process_group("cpu:fake,meta:fake", store=FakeStore(), rank=rank, world_size=world)
    argv = dry_argv(argv, os.path.join(workdir, f"rank{rank}"), save=save)
    if overflow_steps and "--no-check-for-nan-in-loss-and-grad" not in argv:
        argv.append("--no-check-for-nan-in-loss-and-grad")
    # The comm layer takes the path of the backend the flags name (NCCL's in-place reduce-scatter),
    # not the fake one's; a simulated CPU runs gloo's.
    backend = "gloo" if device_kind == "cpu" else job_config(argv, world, local_world).parallel.distributed_backend
    factory = GroupFactory(rank, stands_for=backend)
    device = DeviceStandIn(device=device_kind)

    def gradient_norm():  # device.read_marks grows by one at the end of every training step
        return float("inf") if len(device.read_marks) + 1 in overflow_steps else 1.0

    try:
        with (
            prepare(rank) if prepare else contextlib.nullcontext(),
            host_read.recording() as reads,
            host_read.forcing({"gradient norm": gradient_norm} if overflow_steps else {}),
            device,
            device.phase_hooks(reads),
            device.keeping_activations(),
            device_kernels(device_kind),
            (
                trace.tracing(reads, devices=("cpu", "meta"), collect=True) if streams else contextlib.nullcontext()
            ) as checker,
            contextlib.redirect_stdout(io.StringIO()),
        ):
            # (each rank's log lines are not the report's)
            run = run_rank(argv, world, rank, torch.device("meta"), factory, local_world, cuda=device_kind == "cuda")
        if checker is not None:
            run.stream_check = {
                "semantics": checker.semantics,
                "side_ops": checker.side_ops,
                "violations": checker.violations,
                "found": list(checker.found),
            }
            run.trace = checker.result(run.entries)
        run.memory = {**device.record(), "planner": planner_figures(argv, world, local_world)}
        run.requests = device.requests if device_kind == "cuda" else None
        step_of = {i: k + 1 for k, (lo, hi) in enumerate(device.read_marks) for i in range(lo, hi)}
        run.host_reads = [
            {"what": r.what, "site": r.site, "numel": r.numel, "step": step_of.get(i)} for i, r in enumerate(reads)
        ]
        return run
    finally:
        with stderr_without(FAKE_GROUP_NOTICE):
            dist.destroy_process_group()


# What torch's C++ side prints (to fd 2, below Python's warnings) when the fake multi-device default
# group is destroyed: its hooks check finds no backend of the group's undefined default type. It
# says nothing about the job, one line per rank before the report.
FAKE_GROUP_NOTICE = b"No backend of type 0 found for Process Group"


@contextlib.contextmanager
def stderr_without(notice: bytes):
    """Sends fd 2 to a file for the block, then writes back every line but those containing `notice`:
    errors and every other warning still show, after the block."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = [line for line in caught.read().splitlines(keepends=True) if notice not in line]
            if kept:
                os.write(2, b"".join(kept))


PRELOAD = ["torch.distributed", "torch.testing._internal.distributed.fake_pg", "megazero.run.pretrain"]


def simulate(
    argv: list[str],
    world: int,
    ranks: list[int] | None = None,
    local_world: int | None = None,
    processes: int | None = None,
    prepare=None,
    overflow_steps=(),
    stream_check: bool = True,
    device_kind: str = "cuda",
    save: bool = True,
    plan=None,
) -> list[RankRun]:
    """Runs `ranks` (all of them by default) of a `world`-rank job of pretrain_gpt.py's `argv`.
    `processes` ranks run at once, each in a fresh process forked from a server that imported torch
    and megazero once, in a default group of its own.
    `overflow_steps`: training steps (1-based) whose gradient norm reads inf (the skip path);
    `stream_check` False: the stream layer runs unchecked (about 40% less time); `device_kind`: the
    device simulated, "cuda" or "cpu" (its kernels, memory without the caching allocator); `save`:
    end with a checkpoint save's collectives. `plan` (megazero.dry_run.steady_state.plan) with
    reduced counts: each rank runs at both and its record is extended to the step's microbatches (a
    third run one block further where a peak differs between them); a rank whose runs are not one
    steady block apart is simulated in full (its `steady_state` says why)."""
    ranks = list(range(world)) if ranks is None else list(ranks)
    options = (local_world, prepare, tuple(overflow_steps), stream_check, device_kind, save)
    if plan is None or plan.simulated is None:
        return _in_processes([(argv, r) for r in ranks], world, options, processes)
    from megazero.config.train_config import topology_of
    from megazero.dry_run import steady_state

    cfg = job_config(argv, world, local_world)
    stage = {r: topology_of(cfg, world).coords(r).pp for r in ranks}
    tasks = [(steady_state.reduced_argv(argv, cfg, world, m), r) for r in ranks for m in plan.counts(stage[r])]
    both = _in_processes(tasks, world, options, processes)
    planner = planner_figures(argv, world, local_world)
    done, again, third = {}, {}, {}
    for a, b in zip(both[::2], both[1::2]):
        try:
            done[a.rank] = steady_state.extend(a, b, plan, stage[a.rank])
        except steady_state.ThirdRunNeeded:
            third[a.rank] = (a, b)
        except steady_state.NotPeriodic as why:
            again[a.rank] = f"every microbatch simulated: {why}"
    tasks = [(steady_state.reduced_argv(argv, cfg, world, plan.counts(stage[r])[1] + plan.period), r) for r in third]
    for c in _in_processes(tasks, world, options, processes) if third else []:
        try:
            done[c.rank] = steady_state.extend(*third[c.rank], plan, stage[c.rank], c)
        except steady_state.NotPeriodic as why:
            again[c.rank] = f"every microbatch simulated: {why}"
    for run in _in_processes([(argv, r) for r in again], world, options, processes) if again else []:
        run.steady_state = {"simulated": None, "why": again[run.rank]}
        done[run.rank] = run
    for run in done.values():
        run.memory["planner"] = planner
    return [done[r] for r in ranks]


def _in_processes(tasks: list[tuple], world: int, options: tuple, processes: int | None) -> list[RankRun]:
    """Each (argv, rank) of `tasks` simulated in a fresh process, `processes` at once."""
    from concurrent.futures import ProcessPoolExecutor
    import multiprocessing

    processes = processes or max(1, min(len(tasks), os.cpu_count() or 1))
    if "forkserver" in multiprocessing.get_all_start_methods():
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)
    else:
        context = multiprocessing.get_context("spawn")
    local_world, prepare, overflow_steps, stream_check, device_kind, save = options
    with tempfile.TemporaryDirectory(prefix="megazero-dry-run-") as workdir:
        # One process per rank (max_tasks_per_child=1): nothing a rank caches (a module-level table,
        # a compiled kernel) carries over to the next rank a worker would run.
        with ProcessPoolExecutor(processes, mp_context=context, max_tasks_per_child=1) as pool:
            futures = [
                pool.submit(
                    _simulated_rank,
                    argv,
                    world,
                    r,
                    local_world,
                    os.path.join(workdir, f"{i:06d}"),
                    prepare,
                    overflow_steps,
                    stream_check,
                    device_kind,
                    save,
                )
                for i, (argv, r) in enumerate(tasks)
            ]
            return [f.result() for f in futures]
