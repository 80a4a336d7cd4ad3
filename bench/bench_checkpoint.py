"""Checkpoint save/load cost on 2 gloo ranks on CPU, against torch.save of the same state in the same run.

    ours     megazero.checkpoint: one safetensors file per rank (fp32 master + Adam moments of the
             rank's ZeRO partition, RNG states), fsynced, atomic commit; and --async-save, where the
             step only waits for the host copy and the files are written by a thread
    peer     torch.save of the same per-rank tensors (pickle, as DeepSpeed's per-rank files), with
             the same fsync, so both pay for durability

Reported per rank (worst rank), ZeRO stage 1 and 3, a ~12M-parameter GPT, fp32:
  step ms        median training step without saving
  save ms        time the training loop is blocked by one save (sync: write + fsync + commit;
                 async: host copy + thread start; the write overlaps the next steps)
  lost ms        async only: extra time of the steps that ran while the write was in flight
  bytes/rank     bytes written by each rank against its partition's fp32 master + Adam moments
  load ms        a fresh setup's load_checkpoint of the same checkpoint
and consolidate's peak RSS (a subprocess of tools/convert_checkpoint.py) against the model size.

    python bench/bench_checkpoint.py            # ~1 min on 2 cores
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from megazero.config.train_config import OptimizerConfig, TrainConfig
from megazero.data.synthetic import SyntheticTokens
from megazero.models.config import GPTConfig
from megazero.parallel.topology import Topology
from megazero.testing import DistributedPool
from megazero.data.sampler import MicrobatchSource
from megazero.training import setup, train_step
from megazero.zero.config import ZeroConfig

REPO = Path(__file__).resolve().parent.parent


def _config(stage: int) -> TrainConfig:
    model = GPTConfig(
        vocab_size=8192,
        hidden_size=384,
        num_layers=6,
        num_attention_heads=6,
        seq_length=128,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    return TrainConfig(
        model=model,
        zero=ZeroConfig(stage=stage),
        optimizer=OptimizerConfig(lr=1e-4),
        micro_batch_size=2,
        global_batch_size=4,
        train_iters=1000,
    )


def _fsync_tree(path: Path) -> None:
    for p in path.rglob("*"):
        if p.is_file():
            with open(p, "rb+") as f:
                os.fsync(f.fileno())


def worker(ctx, stage: int, directory: str) -> dict:
    from megazero.checkpoint import CheckpointSaver, load_checkpoint
    from megazero.checkpoint.saver import collect_rank_state

    torch.manual_seed(0)
    groups = ctx.groups(Topology(world_size=2))
    cfg = _config(stage)
    state = setup(cfg, groups)
    source = MicrobatchSource(SyntheticTokens(cfg.model.vocab_size, cfg.model.seq_length), 4, 2, groups.coords.dp, 2)
    it = iter(range(10_000))

    def step() -> float:
        started = time.perf_counter()
        train_step(state, source.batch(next(it)), 1e-4)
        return 1000 * (time.perf_counter() - started)

    for _ in range(2):
        step()
    plain = statistics.median(step() for _ in range(4))
    out = {"step_ms": plain}
    for mode in ("sync", "async"):
        saver = CheckpointSaver(Path(directory) / mode, "bench", async_save=mode == "async")
        started = time.perf_counter()
        saver.save(state, 0)
        out[f"{mode}_save_ms"] = 1000 * (time.perf_counter() - started)
        during = [step() for _ in range(3)]
        started = time.perf_counter()
        saver.finalize()
        out[f"{mode}_finalize_ms"] = 1000 * (time.perf_counter() - started)
        out[f"{mode}_lost_ms"] = sum(during) - 3 * plain
    rank_file = next((Path(directory) / "sync").glob(f"iter_*/rank_{ctx.rank:05d}.safetensors"))
    out["bytes"] = rank_file.stat().st_size
    # What a rank must write: fp32 master + exp_avg + exp_avg_sq of its partition (12 bytes each).
    out["model_state_bytes"] = 12 * sum(s.layout.partition_size for s in state.engine.storages())
    tensors, _ = collect_rank_state(state)
    peer = Path(directory) / f"peer_{ctx.rank}.pt"
    started = time.perf_counter()
    torch.save(tensors, peer)
    _fsync_tree(peer.parent)
    out["peer_save_ms"] = 1000 * (time.perf_counter() - started)
    out["peer_bytes"] = peer.stat().st_size
    fresh = setup(cfg, groups)
    started = time.perf_counter()
    load_checkpoint(fresh, Path(directory) / "sync")
    out["load_ms"] = 1000 * (time.perf_counter() - started)
    started = time.perf_counter()
    torch.load(peer, weights_only=True)
    out["peer_load_ms"] = 1000 * (time.perf_counter() - started)
    out["params"] = sum(p.numel() for p in state.engine.parameters()) if stage < 3 else None
    return out


def main() -> None:
    pool = DistributedPool(2)
    try:
        for stage in (1, 3):
            with tempfile.TemporaryDirectory() as directory:
                results = pool.run(worker, stage, directory)
                worst = {k: max(r[k] for r in results) for k in results[0] if k != "params"}
                print(
                    f"ZeRO-{stage}: step {worst['step_ms']:.0f} ms | sync save {worst['sync_save_ms']:.0f} ms "
                    f"(torch.save {worst['peer_save_ms']:.0f} ms, ratio "
                    f"{worst['sync_save_ms'] / worst['peer_save_ms']:.2f}x) | async save blocks "
                    f"{worst['async_save_ms']:.0f} ms, steps during the write lost "
                    f"{max(0.0, worst['async_lost_ms']):.0f} ms | {worst['bytes'] / 2**20:.1f} MiB/rank = "
                    f"{worst['bytes'] / worst['model_state_bytes']:.2f}x model-state bytes "
                    f"(torch.save {worst['peer_bytes'] / worst['bytes']:.2f}x ours) | load "
                    f"{worst['load_ms']:.0f} ms (torch.load {worst['peer_load_ms']:.0f} ms)"
                )
                if stage == 1:
                    params = results[0]["params"]
                    run = subprocess.run(
                        [
                            sys.executable,
                            str(REPO / "tools" / "convert_checkpoint.py"),
                            "consolidate",
                            "--load",
                            str(Path(directory) / "sync"),
                            "--output",
                            str(Path(directory) / "out"),
                        ],
                        capture_output=True,
                        text=True,
                        check=True,
                    )
                    print(f"consolidate ({params * 4 / 2**20:.0f} MiB of fp32 weights): {run.stdout.strip()}")
    finally:
        pool.close()


if __name__ == "__main__":
    main()
