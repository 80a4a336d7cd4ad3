"""The recipe of a pretraining run, top to bottom in the order it runs on every rank:

    flags -> config -> checks       configure(): the machine, its files, the checkpoint to resume, and
                                    rank 0's locks on the --save folder and the metrics file
    process groups                  env.process_groups(): the rank grid's groups, on the device; then
                                    the run id and run folder, rank 0's (megazero.run.run_folder)
    data                            megazero.data.run_data: datasets, sampler, read-ahead, tokenizer
    model chunks and ZeRO engine    megazero.training.setup
    checkpoint                      megazero.checkpoint.resume.start: load, or start a new run
    the loop                        megazero.training.train

It runs in a `RunEnvironment`: the launch (megazero.run.launch, with the rendezvous, the error line
every rank agrees on, heartbeats and signals around it) or the dry run's simulated one
(megazero.dry_run.job). Neither reads anything back from the recipe but through `Pretraining`.
The locks are let go when `Pretraining.run` ends (or with the process: `release` for the rest).
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Callable, Protocol

import torch


from megazero.checkpoint.resume import Resume, check_resume, start as start_checkpoint
from megazero.config.train_config import TrainConfig, topology_of
from megazero.config.train_flags import config_from_args, parse_args
from megazero.core.comm import CommLog
from megazero.data.run_data import run_data
from megazero.parallel.process_groups import ProcessGroups
from megazero.run.run_folder import agree_identity, lock_metrics, metrics_named_by_flag, with_run_dir
from megazero.training.lr_schedule import step_learning_rate
from megazero.training.metrics import MetricsLogger
from megazero.training.monitor import open_monitors
from megazero.training import setup, train


class RunEnvironment(Protocol):
    """What the recipe asks of the process it runs in."""

    rank: int
    world: int
    local_world: int
    cuda_available: bool | None  # read the flags as on a machine with CUDA; None: torch.cuda says

    def device(self, cfg) -> tuple[torch.device, str]:
        """This rank's device, and the start-up line's words on its thread count ("" for none)."""

    def cpu_optimizer_threads(self) -> int:
        """The offloaded optimizer's CPU Adam threads where the flags leave them unset."""

    def check_machine(self, cfg, device: torch.device) -> None:
        """The config against this machine and its files; a UsageError for the first problem."""

    def process_groups(self, cfg, device: torch.device, log: CommLog) -> ProcessGroups | None:
        """The rank grid's groups holding this rank (None: this process is outside the job)."""

    def first(self, step: str) -> Callable:
        """`first(build)`: build(True) where files are built once for all ranks, build(False) elsewhere."""


@dataclasses.dataclass
class Configured:
    """What configure() learned: the checked config, this rank's device and the checkpoint to resume."""

    cfg: TrainConfig
    device: torch.device
    resume: Resume | None
    threads: str = ""  # the start-up line's thread count


def configure(argv, env: RunEnvironment) -> Configured:
    """Flags -> config -> checks against this machine and the checkpoint; every error a UsageError."""
    cfg = config_from_args(parse_args(argv), env.world, env.local_world, cuda_available=env.cuda_available)
    if cfg.zero.cpu_optimizer_threads is None:
        cfg = cfg.replace(zero=cfg.zero.replace(cpu_optimizer_threads=env.cpu_optimizer_threads()))
    device, threads = env.device(cfg)
    env.check_machine(cfg, device)
    writer = env.rank == 0  # holds the job's locks (megazero.run.run_folder says why rank 0)
    resume = check_resume(
        cfg.checkpoint,
        cfg.model,
        cfg.global_batch_size,
        cfg.optimizer,
        cfg.train_iters,
        (cfg.micro_batch_size, topology_of(cfg, env.world).dp),
        cfg.seed,
        writer=writer,
    )
    if writer and metrics_named_by_flag(cfg):
        try:
            resume.locks.append(lock_metrics(cfg, resume.run_id))
        except BaseException:
            resume.release()
            raise
    # the schedule may be the checkpoint's
    return Configured(cfg.replace(optimizer=resume.optimizer), device, resume, threads)


class Pretraining:
    """One rank's run of the recipe. What it has built so far stays readable while it runs, for
    the driver's closing line and heartbeat: the groups' CommLog, then the TrainState."""

    def __init__(self, configured: Configured, env: RunEnvironment):
        self.cfg, self.device, self.resume = configured.cfg, configured.device, configured.resume
        self.threads, self.env = configured.threads, env
        self.comm_log: CommLog | None = None
        self.state = None

    def release(self) -> None:
        """Lets go of the locks this rank holds for the job (idempotent)."""
        if self.resume is not None:
            self.resume.release()

    def run(self, groups: ProcessGroups | None = None) -> None:
        """Trains on this rank; `groups`: process groups already built (else the environment builds them)."""
        try:
            self._run(groups)
        finally:
            self.release()

    def _run(self, groups: ProcessGroups | None) -> None:
        cfg, env = self.cfg, self.env
        self.comm_log = groups.log if groups is not None else CommLog()
        groups = groups or env.process_groups(cfg, self.device, self.comm_log)
        if groups is None:
            return
        cfg, run_id = self._agree_identity(groups)
        metrics = _open_metrics(cfg, groups, self.device, self.threads, run_id)
        data = run_data(
            cfg,
            groups.coords.dp,
            groups.topology.dp,
            metrics.say,
            first=env.first("data"),
            keep_tokenizer=env.rank == 0 and cfg.checkpoint.save is not None,
        )
        state = self.state = setup(cfg, groups, self.device, eod=data.eod)
        _say_setup(state, self.resume, metrics.say)
        start_iteration, policy = start_checkpoint(
            state, cfg.checkpoint, self.resume.reader if self.resume else None, metrics.say, run_id, data.tokenizer
        )
        if start_iteration >= cfg.train_iters:
            metrics.say(
                f" the checkpoint is at iteration {start_iteration}: --train-iters {cfg.train_iters} "
                f"is done; raise --train-iters to train on"
            )
        metrics.say(
            " model states per rank (MiB): "
            + ", ".join(f"{k}={v / 2**20:.1f}" for k, v in state.engine.memory.report().items())
        )
        try:
            train(
                state,
                data.train,
                data.valid,
                lambda step, done: step_learning_rate(cfg.optimizer, step, cfg.train_iters, done),
                metrics,
                start_iteration=start_iteration,
                policy=policy,
            )
        finally:
            data.close()
        metrics.close()
        saved = cfg.checkpoint.save
        metrics.say(
            f" done: metrics appended to {cfg.metrics_file}"
            + (f"; checkpoints in {saved} (go on with --load {saved})" if saved else "")
        )

    def _agree_identity(self, groups) -> tuple[TrainConfig, str]:
        """The run id and (default) run folder of rank 0 on every rank; rank 0 locks the default
        folder's metrics file and says what its locks found (leftovers removed, no locks there)."""
        cfg, resume = self.cfg, self.resume
        proposed = resume.run_id if resume is not None and resume.run_id else uuid.uuid4().hex
        run_id, run_dir = agree_identity(groups, proposed, cfg.run_dir if cfg.default_run_dir else "")
        if cfg.default_run_dir:
            cfg = self.cfg = with_run_dir(cfg, run_dir)
        if groups.rank == 0 and resume is not None:
            if not metrics_named_by_flag(cfg):
                resume.locks.append(lock_metrics(cfg, run_id))
            for line in [lock.note for lock in resume.locks if lock.note] + resume.writer_lines:
                print(f" {line}", flush=True)
        return cfg, run_id

    def interrupted_line(self) -> str:
        from megazero.checkpoint.files import latest_iteration_name

        iteration = self.state.iteration if self.state is not None else 0
        save = self.cfg.checkpoint.save
        latest = latest_iteration_name(save) if save is not None else None
        kept = (
            "none (no --save)"
            if save is None
            else f"{save}/{latest} (resume with --load {save})"
            if latest
            else f"none yet in {save}"
        )
        return f"interrupted at iteration {iteration}; last checkpoint: {kept}"


def _open_metrics(cfg, groups, device, threads: str = "", run_id: str | None = None) -> MetricsLogger:
    """The log lines and metrics.jsonl (one rank: the first of the last stage), wandb / TensorBoard."""
    topology = groups.topology
    logging_rank = groups.rank == topology.rank_of(0, 0, topology.pp - 1)
    metrics = MetricsLogger(cfg.metrics_file, enabled=logging_rank, total_iters=cfg.train_iters, run_id=run_id)
    metrics.say(
        f" megazero: {topology.describe()} zero_stage={cfg.zero.stage} device={device.type} "
        f"precision={'bf16' if cfg.precision.bf16 else 'fp16' if cfg.precision.fp16 else 'fp32'}"
        + (f" {threads}" if threads else "")
    )
    metrics.say(f" {batch_line(cfg, topology.dp)}")
    saves = f"into {cfg.checkpoint.save}" if cfg.checkpoint.save else "none (no --save)"
    metrics.say(f" run folder: {cfg.run_dir} (metrics.jsonl); checkpoints: {saves}")
    for note in cfg.notes:  # config keys accepted without an effect of their own
        metrics.say(f" note: {note}")
    if logging_rank:  # wandb/TensorBoard; a run that raises is ended by their own exit hooks
        metrics.add_monitors(open_monitors(cfg, metrics.say))
    return metrics


def _say_setup(state, resume, say) -> None:
    say(f" {state.streams.describe()}")
    for notice in resume.notices if resume is not None else ():
        say(f" {notice}")


def batch_line(cfg, dp: int) -> str:
    """The global batch as it resolved (from flags or a DeepSpeed config's train_batch_size,
    micro batch and accumulation steps), and the run's length."""
    micro, glob = cfg.micro_batch_size, cfg.global_batch_size
    ramp = f", growing from {cfg.rampup.start}" if cfg.rampup is not None else ""
    source = f" (set by {cfg.batch_from})" if cfg.batch_from else ""
    return (
        f"batch: global {glob} samples{ramp} = micro batch {micro} x data-parallel {dp} x "
        f"{glob // (micro * dp)} accumulation steps{source}; {cfg.train_iters} iteration"
        f"{'s' if cfg.train_iters != 1 else ''}, {cfg.model.seq_length} tokens a sample"
    )
