"""Pretrain a GPT with tensor x pipeline x ZeRO data parallelism.

    python pretrain_gpt.py                                   # small GPT on the embedded corpus, 1 CPU
    torchrun --nproc-per-node 4 pretrain_gpt.py --tensor-model-parallel-size 2 --zero-stage 3

Flags follow Megatron-LM's names (see --help). The driver only wires things together: flags ->
config (all validation, before any process group or file) -> process groups -> data -> model chunks
-> ZeRO engine -> training loop.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from megazero.arguments import config_from_args, parse_args
from megazero.config import TrainConfig
from megazero.errors import UsageError
from megazero.lr_schedule import learning_rate
from megazero.metrics import MetricsLogger
from megazero.parallel.groups import ProcessGroups
from megazero.parallel.topology import Topology
from megazero.training import MicrobatchSource, setup, train


def _device(cfg: TrainConfig, local_rank: int) -> torch.device:
    if cfg.parallel.distributed_backend == "nccl":
        if not torch.cuda.is_available():
            raise UsageError("--distributed-backend nccl needs CUDA GPUs; use gloo on CPU")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _datasets(cfg: TrainConfig, groups: ProcessGroups, say):
    """Train and valid datasets; the embedded corpus is prepared by rank 0 while the others wait."""
    from megazero.data.builders import build_train_valid_test_datasets
    from megazero.data.default_data import prepare_default_data
    data_path, first = cfg.data.data_path, groups.rank == 0
    if data_path is None:
        if first:
            prefix, _ = prepare_default_data(cfg.data.cache_dir, progress=True)
        if dist.is_initialized():
            dist.barrier()
        prefix, tokenizer = prepare_default_data(cfg.data.cache_dir, progress=False)
        say(f" data: embedded corpus (Python standard library sources) at {prefix}")
        data_path = [str(prefix)]
    counts = (cfg.train_iters * cfg.global_batch_size, cfg.eval_iters * cfg.global_batch_size, 0)
    build = lambda progress: build_train_valid_test_datasets(  # noqa: E731
        data_path, cfg.data.split, cfg.model.seq_length, cfg.seed, counts, cfg.data.cache_dir, progress)
    if first:
        build(True)        # builds and caches the sample indices once
    if dist.is_initialized():
        dist.barrier()
    train_set, valid_set, _ = build(False)
    return train_set, valid_set


def run(cfg: TrainConfig, rank: int, world: int, local_rank: int) -> None:
    device = _device(cfg, local_rank)
    if world > 1:
        # Binding NCCL to this rank's GPU makes it create its communicators now (not at the first
        # collective) and lets barriers and new groups know the device without guessing.
        backend = cfg.parallel.distributed_backend
        bind = dict(device_id=device) if backend == "nccl" else {}
        dist.init_process_group(backend, rank=rank, world_size=world, **bind)
    par = cfg.parallel
    topology = Topology(world_size=world, tp=par.tensor_parallel, pp=par.pipeline_parallel,
                        mics_shard_size=cfg.zero.mics_shard_size, ranks_per_node=par.ranks_per_node)
    groups = ProcessGroups.build(topology, rank, device=device)
    logging_rank = rank == topology.rank_of(0, 0, topology.pp - 1)
    metrics = MetricsLogger(cfg.metrics_file, enabled=logging_rank, total_iters=cfg.train_iters)
    metrics.say(f" megazero: {topology.describe()} zero_stage={cfg.zero.stage} device={device.type} "
                f"precision={'bf16' if cfg.precision.bf16 else 'fp16' if cfg.precision.fp16 else 'fp32'}")
    for note in cfg.notes:          # config keys accepted without an effect of their own
        metrics.say(f" note: {note}")
    train_set, valid_set = _datasets(cfg, groups, metrics.say)
    state = setup(cfg, groups, device)
    metrics.say(f" {state.streams.describe()}")
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
    train(state, source, valid_batches,
          lambda it: learning_rate(cfg.optimizer, it, cfg.train_iters), metrics)
    metrics.say(f" done: metrics appended to {cfg.metrics_file}")
    if dist.is_initialized():
        dist.destroy_process_group()


def main(argv=None) -> int:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    try:
        cfg = config_from_args(parse_args(argv), world, local_world)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world)))
        run(cfg, rank, world, local_rank)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
