"""The driver behind pretrain_gpt.py: flags -> config -> checks against the machine and files ->
process groups -> data -> model chunks -> ZeRO engine -> training loop. It wires the rooms together
and holds no training logic of its own (that is megazero.training's).

Errors end a launch with one line. Those found before the process group starts (flags, paths, data,
memory) are found on every rank and agreed through the launch's rendezvous store, and rank 0 prints
the verdict for all; one found later is printed by the rank that found it, which marks the store so
that the others, cut off mid-collective, leave quietly instead of each printing a connection error.

It is the one module that reads the launcher's environment (WORLD_SIZE, RANK, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, TORCHELASTIC_RESTART_COUNT); what the runtime needs of it travels on
in `Launch` and `TrainConfig`.
"""
from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist

from megazero.core import stream_check
from megazero.checkpoint.run import preflight as checkpoint_preflight, start as checkpoint_start
from megazero.config.arguments import config_from_args, parse_args
from megazero.config.preflight import preflight, sample_counts
from megazero.config.train_config import TrainConfig
from megazero.core.errors import UsageError
from megazero.lr_schedule import learning_rate
from megazero.metrics import MetricsLogger
from megazero.monitor import open_monitors
from megazero.parallel.groups import ProcessGroups
from megazero.parallel.topology import Topology
from megazero.training import MicrobatchSource, setup, train


class AgreedStop(Exception):
    """Every rank stops after an agreement: rank 0 prints the message, the others leave quietly."""


class Launch:
    """This process's place in a launch (torchrun, the deepspeed launcher, or none) and the
    rendezvous store its ranks share before and after the process group exists."""

    def __init__(self):
        env = os.environ
        self.world = int(env.get("WORLD_SIZE", "1"))
        self.rank = int(env.get("RANK", "0"))
        self.local_rank = int(env.get("LOCAL_RANK", "0"))
        self.local_world = int(env.get("LOCAL_WORLD_SIZE", str(self.world)))
        self._local_rank_from_env = "LOCAL_RANK" in env
        self._prefix = f"megazero/attempt{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        self.rendezvous_store = self.store = None     # the launch's store; our keys under a prefix

    def adopt_local_rank(self, flag_value: int | None) -> None:
        """Older launchers pass --local_rank instead of setting LOCAL_RANK."""
        if flag_value is not None and not self._local_rank_from_env:
            self.local_rank = flag_value

    def connect(self) -> None:
        """Joins the rendezvous store (no process group yet) when there is a launch to coordinate."""
        if self.world > 1 and self.store is None and "MASTER_ADDR" in os.environ:
            self.rendezvous_store, _, _ = next(dist.rendezvous("env://", self.rank, self.world,
                                                               timeout=datetime.timedelta(minutes=30)))
            self.store = dist.PrefixStore(self._prefix, self.rendezvous_store)

    @property
    def speaks(self) -> bool:
        """Whether this rank prints agreed errors: rank 0, or every rank where nothing is shared."""
        return self.rank == 0 or self.store is None

    def agree(self, step: str, error: str | None) -> str | None:
        """Every rank reports how `step` went; rank 0 reads the reports and posts the verdict (its
        own error, else the first other rank's), which every rank returns. Doubles as a barrier."""
        self.connect()
        if self.store is None:
            return error
        self.store.set(f"{step}/{self.rank}", error or "")
        if self.rank == 0:
            self.store.set(f"{step}/verdict", error or self._first_other_report(step))
        return self.store.get(f"{step}/verdict").decode() or None

    def _first_other_report(self, step: str) -> str:
        for other in range(1, self.world):
            report = self.store.get(f"{step}/{other}").decode()    # waits for that rank's report
            if report:
                return f"rank {other}: {report}"
        return ""

    def another_rank_failed(self) -> bool:
        try:
            return self.store is not None and self.store.check(["failed"]) and \
                self.store.get("failed").decode() != str(self.rank)
        except (RuntimeError, ValueError):     # the store went down with its host rank
            return False

    def mark_failed(self) -> None:
        if self.store is not None:
            try:
                self.store.set("failed", str(self.rank))
            except (RuntimeError, ValueError):
                pass


def _device(cfg: TrainConfig, local_rank: int) -> torch.device:
    if cfg.parallel.distributed_backend == "nccl":
        if not torch.cuda.is_available():
            raise UsageError("--distributed-backend nccl needs CUDA GPUs; use gloo on CPU")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _datasets(cfg: TrainConfig, launch: Launch, say):
    """Train and valid datasets; rank 0 prepares the embedded corpus and the sample indices while the
    others wait for its verdict."""
    from megazero.data.builders import build_train_valid_test_datasets
    from megazero.data.default_data import prepare_default_data

    def build(progress):
        data_path = cfg.data.data_path
        if data_path is None:
            prefix, _ = prepare_default_data(cfg.data.cache_dir, progress=progress)
            say(f" data: embedded corpus (Python standard library sources) at {prefix}")
            data_path = [prefix]
        return build_train_valid_test_datasets(data_path, cfg.data.split, cfg.model.seq_length, cfg.seed,
                                               sample_counts(cfg), cfg.data.cache_dir, progress)

    error = None
    if launch.rank == 0:
        try:
            built = build(True)           # builds and caches what is missing, once
        except UsageError as err:
            error = str(err)
    verdict = launch.agree("data", error)
    if verdict:
        raise AgreedStop(verdict)
    train_set, valid_set, _ = built if launch.rank == 0 else build(False)
    return train_set, valid_set


def run(cfg: TrainConfig, launch: Launch, device: torch.device, checkpoint=(None, None)) -> None:
    if launch.world > 1:
        # Binding NCCL to this rank's GPU makes it create its communicators now (not at the first
        # collective) and lets barriers and new groups know the device without guessing.
        backend = cfg.parallel.distributed_backend
        bind = dict(device_id=device) if backend == "nccl" else {}
        store = dict(store=launch.rendezvous_store) if launch.store is not None else {}
        dist.init_process_group(backend, rank=launch.rank, world_size=launch.world, **store, **bind)
    par = cfg.parallel
    topology = Topology(world_size=launch.world, tp=par.tensor_parallel, pp=par.pipeline_parallel,
                        cp=par.context_parallel, mics_shard_size=cfg.zero.mics_shard_size, ranks_per_node=par.ranks_per_node,
                        hpz_partition_size=cfg.zero.zero_hpz_partition_size if cfg.zero.stage == 3 else 1)
    groups = ProcessGroups.build(topology, launch.rank, device=device)
    logging_rank = launch.rank == topology.rank_of(0, 0, topology.pp - 1)
    metrics = MetricsLogger(cfg.metrics_file, enabled=logging_rank, total_iters=cfg.train_iters)
    metrics.say(f" megazero: {topology.describe()} zero_stage={cfg.zero.stage} device={device.type} "
                f"precision={'bf16' if cfg.precision.bf16 else 'fp16' if cfg.precision.fp16 else 'fp32'}")
    for note in cfg.notes:          # config keys accepted without an effect of their own
        metrics.say(f" note: {note}")
    if logging_rank:     # wandb/TensorBoard; a run that raises is ended by their own exit hooks
        metrics.add_monitors(open_monitors(cfg, metrics.say))
    train_set, valid_set = _datasets(cfg, launch, metrics.say)
    state = setup(cfg, groups, device)
    metrics.say(f" {state.streams.describe()}")
    reader, notice = checkpoint
    if notice:
        metrics.say(f" {notice}")
    start_iteration, policy = checkpoint_start(state, cfg.checkpoint, reader, metrics.say)
    report = state.engine.memory_report()
    metrics.say(" model states per rank (MiB): " + ", ".join(
        f"{k}={v / 2**20:.1f}" for k, v in report.items()))
    source = MicrobatchSource(train_set, cfg.global_batch_size, cfg.micro_batch_size,
                              groups.coords.dp, topology.dp)
    valid_batches = []
    if valid_set is not None and cfg.eval_iters > 0:
        valid_source = MicrobatchSource(valid_set, cfg.global_batch_size, cfg.micro_batch_size,
                                        groups.coords.dp, topology.dp)
        valid_batches = [valid_source.batch(i) for i in range(cfg.eval_iters)]
    train(state, source, valid_batches, lambda it: learning_rate(cfg.optimizer, it, cfg.train_iters),
          metrics, start_iteration=start_iteration, policy=policy)
    metrics.close()
    metrics.say(f" done: metrics appended to {cfg.metrics_file}")
    if dist.is_initialized():
        dist.destroy_process_group()


def _checked_config(argv, launch: Launch) -> tuple[TrainConfig, torch.device, tuple]:
    """Flags -> config -> checks against this machine; every error a UsageError."""
    args = parse_args(argv)
    launch.adopt_local_rank(args.local_rank)
    cfg = config_from_args(args, launch.world, launch.local_world)
    device = _device(cfg, launch.local_rank)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, launch.local_world)))
    preflight(cfg, launch.world, launch.local_world, device)
    checkpoint = checkpoint_preflight(cfg.checkpoint, cfg.model, cfg.global_batch_size)
    if launch.world > 1 and "MASTER_ADDR" not in os.environ:
        raise UsageError(f"WORLD_SIZE={launch.world} is set but MASTER_ADDR is not; start the ranks with "
                         f"torchrun (or set MASTER_ADDR and MASTER_PORT)")
    return cfg, device, checkpoint


def main(argv=None) -> int:
    launch = Launch()
    error = None
    try:
        cfg, device, checkpoint = _checked_config(argv, launch)
    except UsageError as err:
        error = str(err)
    try:
        verdict = launch.agree("preflight", error)
    except (RuntimeError, ValueError) as err:      # no rendezvous: nothing to agree with
        print(f"error: cannot join the launch's rendezvous ({str(err).splitlines()[0]}); start the "
              f"ranks with torchrun", file=sys.stderr)
        return 2
    if verdict:
        if launch.speaks:
            print(f"error: {verdict}", file=sys.stderr)
        return 2
    try:
        with stream_check.for_launch(os.environ.get("MEGAZERO_STREAM_CHECK", "0") != "0", device,
                                     launch.store, launch.rank, launch.world):
            run(cfg, launch, device, checkpoint)
    except AgreedStop as stop:
        if launch.speaks:
            print(f"error: {stop}", file=sys.stderr)
        dist.destroy_process_group()     # every rank is here: nothing is left in flight
        return 2
    except Exception as err:
        if launch.another_rank_failed():   # cut off by the rank that failed; it printed the line
            return 2
        launch.mark_failed()
        if not isinstance(err, UsageError):
            raise
        print(f"error: {err}" if launch.world == 1 else f"error: rank {launch.rank}: {err}", file=sys.stderr)
        return 2
    return 0

