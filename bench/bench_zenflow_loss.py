"""ZenFlow's loss against Adam's, part by part: where the gap of a short run from scratch comes from.

One process, stage 2 fp32, the same model, init and data (the embedded stdlib corpus, vocabulary
8192) on every side; --steps steps. Each side is a `zenflow` block, sometimes with one part of the
algorithm changed by a patch of this script (not a feature of megazero):

  device <names>   those parameters (name prefixes) always selected: stepped on the device every step
  window steps     the CPU Adam's bias correction counts windows (1, 2, ...) instead of the global
                   step at the window's end (DeepSpeed's step_id, megazero's rule)
  summed           the CPU Adam takes the window's summed gradient instead of its mean

Printed per side: the final loss (mean of the last 10 steps), its gap to the device Adam's and the
number of CPU Adam windows (the updates the unselected columns got), and the device Adam's loss
after steps / 4 steps (as many updates as they get at update_interval 4). `--schedule pretrain` uses pretrain_gpt.py's optimizer defaults (warmup 20,
cosine to lr / 10, beta2 0.95, clip 1.0); `bench` those of bench_offload.py --zenflow (constant lr,
beta2 0.999, clip 1.0).

    python bench/bench_zenflow_loss.py --steps 200 --schedule pretrain        # ~5 min a side, loaded 2 cores
    python bench/bench_zenflow_loss.py --sides adam zenflow "zenflow, auto"
    python bench/bench_zenflow_loss.py --count windows --sides adam zenflow "zenflow, auto"

`--count windows` counts DeepSpeed's steps, its update boundaries (it sets its gradient
accumulation to update_interval k and does the selective step and the lr schedule's step at every
micro-batch): a ZenFlow side trains k x steps of ours, the device Adam steps of k accumulated
micro-batches; the same samples on both. `--pretrain N` starts every side from N steps of the
device Adam with a fresh optimizer (fine-tuning, ZenFlow's own setting).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time

REAL = {"topk_ratio": 0.05, "update_interval": 4, "overlap_step": True}
EMBEDDINGS = ["embedding."]
LAYERS = ["layers."]
# side -> (zenflow block or None for the device Adam, patches)
SIDES = {
    "adam": (None, {}),
    "zenflow": (REAL, {}),
    "no overlap": ({**REAL, "overlap_step": False}, {}),
    "topk 0, no overlap": ({**REAL, "topk_ratio": 0.0, "overlap_step": False}, {}),
    "topk 0.25": ({**REAL, "topk_ratio": 0.25}, {}),
    "update_interval 2": ({**REAL, "update_interval": 2}, {}),
    "reselect every 4": ({**REAL, "select_strategy": "step", "select_interval": 4}, {}),
    "embeddings on device": (REAL, {"device": EMBEDDINGS}),
    "layers on device": (REAL, {"device": LAYERS}),
    "window steps": (REAL, {"window_steps": True}),
    "summed": (REAL, {"summed": True}),
    "zenflow, auto": ({**REAL, "update_interval": "auto"}, {}),
}


def patch(zenflow_class, names: dict, patches: dict) -> None:
    """Applies this script's changes of the algorithm to ZenFlowOffload (in the worker process,
    which runs one side after another: the last side's changes are undone first)."""
    originals = vars(zenflow_class).get("_unpatched")
    if originals is None:
        originals = zenflow_class._unpatched = {k: vars(zenflow_class)[k] for k in ("_select", "_cpu_adam")}
    for key, method in originals.items():
        setattr(zenflow_class, key, method)
    if patches.get("device"):
        select = zenflow_class._select

        def select_with_device_params(self, storage):
            select(self, storage)
            for i, param in enumerate(storage.params):
                piece = storage.layout.local_piece(i)
                if piece is not None and names[id(param)].startswith(tuple(patches["device"])):
                    self.mask[piece.partition_offset : piece.partition_offset + piece.length] = 1

        zenflow_class._select = select_with_device_params
    if patches.get("window_steps") or patches.get("summed"):
        cpu_adam = zenflow_class._cpu_adam

        def changed_cpu_adam(self, grad, cpu_step, lr, config, scale, threads):
            k = self.flow.update_interval
            if patches.get("window_steps"):
                cpu_step = max(1, (cpu_step - self.flow.full_warm_up_rounds) // k)
            cpu_adam(self, grad, cpu_step, lr, config, scale * (k if patches.get("summed") else 1), threads)

        zenflow_class._cpu_adam = changed_cpu_adam


def worker(ctx, args, side, data_prefix, start=None, save=None):
    """Trains args.steps steps of one side (from the weights of the checkpoint `start`, on the
    corpus after the samples it saw, with a fresh optimizer: a fine-tuning run), or with `save`
    args.pretrain steps of the device Adam saved there; returns its losses."""
    import torch

    from megazero.config.train_config import OptimizerConfig, ParallelConfig, TrainConfig
    from megazero.data.builders import build_train_valid_test_datasets
    from megazero.checkpoint.loader import load_checkpoint
    from megazero.checkpoint.saver import CheckpointSaver
    from megazero.training.lr_schedule import step_learning_rate
    from megazero.models.config import GPTConfig
    from megazero.ops.adam_config import AdamConfig
    from megazero.parallel.topology import Topology
    from megazero.data.sampler import MicrobatchSource
    from megazero.training import setup, train_step
    from megazero.zero.zenflow import optimizer as zenflow
    from megazero.zero.config import ZeroConfig

    torch.set_num_threads(args.threads)
    block, patches = SIDES[side]
    zero = {"stage": 2}
    if block is not None:
        zero.update(offload_optimizer={"device": "cpu"}, zenflow=block)
    model = GPTConfig(
        vocab_size=8192,
        padded_vocab_size=8192,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_attention_heads=4,
        ffn_hidden_size=4 * args.hidden,
        seq_length=args.seq,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    if args.schedule == "pretrain":  # pretrain_gpt.py's defaults
        opt = OptimizerConfig(
            lr=args.lr,
            min_lr=args.lr / 10,
            warmup_iters=min(20, args.steps // 10),
            adam=AdamConfig(lr=args.lr, beta2=0.95, weight_decay=0.01),
        )
    else:  # bench_offload.py --zenflow's
        opt = OptimizerConfig(lr=args.lr, decay_style="constant", adam=AdamConfig(lr=args.lr, weight_decay=0.01))
    steps = args.pretrain if save else args.steps
    skip = args.pretrain if start else 0  # the pretraining's batches come first
    micro, batch = args.batch, args.batch
    if args.count == "windows" and not save:  # DeepSpeed's steps: update boundaries
        k = REAL["update_interval"]
        if block is None:  # its accumulation of k micro-batches
            batch, skip = k * micro, skip // k
        else:  # its micro-steps, the lr schedule's steps
            steps = k * steps
            opt = opt.replace(warmup_iters=k * opt.warmup_iters)
    cfg = TrainConfig(
        model=model,
        zero=ZeroConfig(**zero),
        micro_batch_size=micro,
        global_batch_size=batch,
        train_iters=steps,
        seed=1,
        parallel=ParallelConfig(),
        optimizer=opt,
    )
    state = setup(cfg, ctx.groups(Topology(world_size=1, tp=1, pp=1)))
    names = {id(p): n for chunk in state.chunks for n, p in chunk.named_parameters()}
    patch(zenflow.ZenFlowOffload, names, patches)
    if start:
        load_checkpoint(state, start, finetune=True)
    train, _, _ = build_train_valid_test_datasets(
        data_prefix, "100,0,0", args.seq, 1, ((skip + steps) * batch, 0, 0), progress=False
    )
    source = MicrobatchSource(train, batch, micro, 0, 1)
    losses = [
        train_step(state, source.batch(skip + it), step_learning_rate(opt, it + 1, steps)).loss for it in range(steps)
    ]
    if save:
        CheckpointSaver(save, "pretrain").save(state, steps * args.batch)
        return losses, 0
    storages = state.engine.storages() if block is not None else []
    for storage in storages:
        storage.offload.settle()  # the last window's CPU Adam has ended
    updates = [storage.offload.stats["cpu_updates"] for storage in storages]
    return losses, max(updates, default=0)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--schedule", choices=["pretrain", "bench"], default="pretrain")
    parser.add_argument("--sides", nargs="+", default=list(SIDES), choices=list(SIDES))
    parser.add_argument(
        "--count",
        choices=["steps", "windows"],
        default="steps",
        help="windows: --steps counts DeepSpeed's optimizer steps, its update boundaries: "
        "a ZenFlow side trains update_interval x steps micro-steps (DeepSpeed's lr "
        "schedule steps with them), the device Adam steps accumulates update_interval "
        "micro-batches each (the same config without the zenflow block): the same "
        "samples, and as many full updates",
    )
    parser.add_argument(
        "--pretrain",
        type=int,
        default=0,
        help="first train this many steps with the device Adam; every side then starts "
        "from those weights with a fresh optimizer (fine-tuning, ZenFlow's setting)",
    )
    args = parser.parse_args(argv)
    from megazero.data.default_data import prepare_default_data
    from megazero.testing import DistributedPool

    prefix, _ = prepare_default_data(progress=False)
    sides = ["adam"] + [s for s in args.sides if s != "adam"]
    print(
        f"model: hidden {args.hidden}, {args.layers} layers, vocab 8192, seq {args.seq}, batch {args.batch}; "
        f"stage 2 fp32; {args.steps} steps, lr {args.lr}, schedule {args.schedule}",
        flush=True,
    )
    print("| side | final loss | vs adam | CPU Adam windows | minutes |\n|---|---|---|---|---|", flush=True)
    pool = DistributedPool(1)
    final = {}
    start = tempfile.mkdtemp(prefix="zenflow-pretrain-") if args.pretrain else None
    try:
        if start:
            losses, _ = pool.run(worker, args, "adam", prefix, None, start, timeout=4 * 3600)[0]
            print(
                f"pretrained: {args.pretrain} steps of the device Adam, loss {sum(losses[-10:]) / 10:.4f}; "
                f"every side fine-tunes from there",
                flush=True,
            )
        for side in sides:
            began = time.time()
            losses, windows = pool.run(worker, args, side, prefix, start, timeout=4 * 3600)[0]
            tail = 10 * (len(losses) // args.steps)  # the last 10 steps' samples
            final[side] = sum(losses[-tail:]) / tail
            if side == "adam":
                windows = max(10, args.steps // 4)
                adam_early = sum(losses[windows - 10 : windows]) / 10
            gap = 100 * (final[side] - final["adam"]) / final["adam"]
            print(
                f"| {side} | {final[side]:.4f} | {gap:+.1f}% | {windows or '-'} | {(time.time() - began) / 60:.1f} |",
                flush=True,
            )
    finally:
        pool.close()
        if start:
            shutil.rmtree(start, ignore_errors=True)
    print(f"adam after {max(10, args.steps // 4)} steps: {adam_early:.4f}")


if __name__ == "__main__":
    main()
