"""megazero against implementations it does not own: a plain torch training loop (one process),
DDP and FSDP2 (ZeRO stages), the single-device model (tensor parallelism).

The parity suites compare every layout with megazero's single-process run; they share its Adam,
clipping, weight-decay rule, lr schedule and loss code, so a bug in any of those passes them all.
Here the other side is written in the test from torch and from Megatron-LM's / DeepSpeed's
documented rules (reference_rules.py). Each test names, in its docstring, the bugs it was seen to
catch (planted by hand, one at a time; tests/README.md lists them all).
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from tests.driver import run_main
from tests.layouts import assemble_params, small_config, with_padded_vocab
from megazero.checkpoint.reader import CheckpointReader
from megazero.data.indexed_dataset import IndexedDatasetBuilder
from megazero.models.config import GPTConfig
from tests.references.reference_rules import (
    adamw,
    assert_same_losses,
    assert_same_params,
    megatron_lr,
    plain_gpt,
    without_key_bias,
)
from megazero.models.param_info import param_info
from tests.metrics_reading import metrics_records


# --- 1. pretrain_gpt.py, one process, fp32, against a plain torch loop --------------------------

TOKENS = 63  # NullTokenizer ids 0..62; 63 is its end-of-document id
SEQ, MICRO, GLOBAL, STEPS, SEED = 32, 2, 4, 20, 1234
MODEL = dict(
    num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=SEQ, hidden_dropout=0.0, attention_dropout=0.0
)
# Chosen so that clipping bites on some steps and not on others, the warmup and the decay both
# show, and the last steps run at min-lr (the decay ends at 16 of 20).
OPT = dict(lr=1e-2, min_lr=1e-3, warmup=3, decay=16, clip=1.3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)


def write_corpus(prefix) -> None:
    """Arithmetic progressions mod TOKENS, one per document: learnable, so the loss moves."""
    rng = np.random.default_rng(0)
    with IndexedDatasetBuilder(prefix, np.uint16) as builder:
        for _ in range(300):
            start, stride, length = rng.integers(0, TOKENS), rng.integers(1, 7), rng.integers(10, 70)
            builder.add_document((start + stride * np.arange(length)) % TOKENS)
        builder.finalize()


def pretrain_argv(tmp_path, style: str) -> list[str]:
    shape = [f"--{k.replace('_', '-')}={v}" for k, v in MODEL.items()]
    return shape + [
        "--data-path",
        str(tmp_path / "corpus"),
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        str(TOKENS + 1),
        "--split",
        "100,0,0",
        "--seed",
        str(SEED),
        "--micro-batch-size",
        str(MICRO),
        "--global-batch-size",
        str(GLOBAL),
        "--train-iters",
        str(STEPS),
        "--lr",
        str(OPT["lr"]),
        "--min-lr",
        str(OPT["min_lr"]),
        "--lr-warmup-iters",
        str(OPT["warmup"]),
        "--lr-decay-iters",
        str(OPT["decay"]),
        "--lr-decay-style",
        style,
        "--clip-grad",
        str(OPT["clip"]),
        "--weight-decay",
        str(OPT["weight_decay"]),
        "--adam-beta1",
        str(OPT["betas"][0]),
        "--adam-beta2",
        str(OPT["betas"][1]),
        "--adam-eps",
        str(OPT["eps"]),
        "--eval-iters",
        "0",
        "--log-interval",
        "1",
        "--metrics-file",
        str(tmp_path / "metrics.jsonl"),
        "--save",
        str(tmp_path / "ck"),
        "--data-cache-path",
        str(tmp_path / "cache"),
        "--run-dir",
        str(tmp_path / "run"),
    ]


def torch_training(
    model,
    optimizer,
    batches,
    *,
    tokens_per_step: int,
    clip: float,
    lr_at,
    world: int = 1,
    sync=lambda last: contextlib.nullcontext(),
) -> tuple[list, list]:
    """The plain torch loop every reference here runs: each microbatch's summed token losses over the
    global batch's tokens, backward (times the world size: DDP and FSDP2 average over ranks, megazero
    sums), clip_grad_norm_, the optimizer step at lr_at(steps done). `sync(last)`: the peer's
    context that holds back the gradient reduction until the last microbatch. Returns this rank's
    loss per step and the gradient norms."""
    losses, norms = [], []
    for done, microbatches in enumerate(batches):
        loss_sum = 0.0
        for j, tokens in enumerate(microbatches):
            with sync(j == len(microbatches) - 1):
                loss = model(tokens[:, :-1], tokens[:, 1:]).float().sum() / tokens_per_step
                (loss * world if world > 1 else loss).backward()
            loss_sum += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        for group in optimizer.param_groups:
            group["lr"] = lr_at(done)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss_sum)
    return losses, norms


@pytest.mark.parametrize(
    "style,adam", [("cosine", "kernel"), ("linear", "torch-adam"), ("inverse-square-root", "kernel")]
)
def test_pretrain_gpt_matches_a_plain_torch_training_loop(tmp_path, capsys, monkeypatch, style, adam):
    """`pretrain_gpt.py` (flags -> config -> engine -> training loop, in-process) trains 20 steps as
    torch.optim.AdamW + clip_grad_norm_ + Megatron's decay groups and lr schedule do: every loss and
    every final parameter (read back from its checkpoint) within 1e-6 relative.

    Kills: weight decay on biases and norm weights; clipping by the squared or the unsquared (L1)
    norm; the warmup one step late or early; cosine or linear decay over the wrong period;
    inverse-square-root not ending at min-lr; no Adam bias correction in the C++ kernel (cosine,
    inverse-square-root) or in megazero's torch reference Adam (linear, run with
    MEGAZERO_DISABLE_CPP_ADAM=1). The schedule counting skipped steps is test_fp16_*'s."""
    from megazero.data import sampler

    if adam == "torch-adam":  # megazero's torch reference Adam instead of the C++ kernel
        monkeypatch.setenv("MEGAZERO_DISABLE_CPP_ADAM", "1")
    write_corpus(tmp_path / "corpus")
    seen_at: dict[int, list[torch.Tensor]] = {}
    batch = sampler.MicrobatchSource.batch

    def recording(source, i):  # the tokens pretrain_gpt trains on, step by step
        out = batch(source, i)
        seen_at[i] = [t.clone() for t in out]  # by step: a read-ahead thread may fetch out of order
        return out

    monkeypatch.setattr(sampler.MicrobatchSource, "batch", recording)
    code, out = run_main(pretrain_argv(tmp_path, style), capsys)
    assert code == 0, out.err
    records = metrics_records(tmp_path / "metrics.jsonl")
    seen = [seen_at[i] for i in sorted(seen_at)]
    assert sorted(seen_at) == list(range(STEPS)) and all(len(mbs) == GLOBAL // MICRO for mbs in seen)

    cfg = GPTConfig(vocab_size=TOKENS + 1, padded_vocab_size=128, **MODEL)
    model = plain_gpt(cfg, SEED)
    optimizer = adamw(model, OPT["weight_decay"], OPT["betas"], OPT["eps"])
    losses, norms = torch_training(
        model,
        optimizer,
        seen,
        tokens_per_step=GLOBAL * SEQ,
        clip=OPT["clip"],
        lr_at=lambda done: megatron_lr(
            done, lr=OPT["lr"], min_lr=OPT["min_lr"], warmup=OPT["warmup"], decay=OPT["decay"], style=style
        ),
    )
    params = {n: p.detach() for n, p in model.named_parameters()}
    clipped = sum(n > OPT["clip"] for n in norms)
    assert 3 <= clipped <= STEPS - 3, f"clipping must bite on some steps and not others: {norms}"
    assert_same_losses([r["loss"] for r in records], losses, f"{style}: loss")
    assert_same_losses([r["grad_norm"] for r in records], norms, f"{style}: grad norm")
    reader = CheckpointReader(tmp_path / "ck")
    saved = {name: reader.full_tensor(name).view(params[name].shape) for name in reader.names}
    assert_same_params(without_key_bias(saved, cfg), without_key_bias(params, cfg), f"{style}: final parameters")


@pytest.mark.parametrize("style", ["constant", "linear", "cosine", "inverse-square-root"])
def test_lr_schedule_is_megatrons_at_every_step(style):
    """megazero.training.lr_schedule.learning_rate(cfg, n, train_iters), the rate of the n-th applied step,
    equals Megatron's rule after n - 1 steps for every step of several warmup / decay / length
    settings (decay_iters unset means train_iters, as Megatron's --lr-decay-iters), constant
    included, which no training test here runs."""
    from megazero.config.train_config import OptimizerConfig
    from megazero.training.lr_schedule import learning_rate

    for warmup, decay, train in [(0, None, 10), (3, None, 12), (4, 8, 12), (1, 2, 5), (5, 20, 30)]:
        cfg = OptimizerConfig(lr=3e-3, min_lr=3e-4, warmup_iters=warmup, decay_iters=decay, decay_style=style)
        for step in range(1, train + 1):
            expected = megatron_lr(step - 1, lr=3e-3, min_lr=3e-4, warmup=warmup, decay=decay or train, style=style)
            assert learning_rate(cfg, step, train) == pytest.approx(expected, rel=1e-12, abs=0.0), (
                warmup,
                decay,
                train,
                step,
            )


# --- 2. several ranks: ZeRO against DDP and FSDP2, TP against the single-device model ------------

PEER_STEPS, PEER_CLIP = 5, 1.1


def peer_config(stage: int = 0, tp: int = 1):
    """A 2-layer GPT, 2 microbatches per rank at dp 2, ZeRO buckets small enough to cut the model
    into several (stage 3: every unit partitioned)."""
    cfg = with_padded_vocab(
        small_config(
            tp=tp,
            stage=stage,
            steps=PEER_STEPS,
            layers=2,
            global_batch=8,
            clip=PEER_CLIP,
            lr=2e-3,
            zero_extra={"param_persistence_threshold": 0},
        )
    )
    return cfg


def peer_lr(done: int) -> float:
    return megatron_lr(done, lr=2e-3, min_lr=2e-4, warmup=0, decay=PEER_STEPS, style="cosine")


def peer_batches(cfg, dp_rank: int, dp: int) -> list[list[torch.Tensor]]:
    from tests.layouts import microbatches

    source = microbatches(cfg, dp_rank=dp_rank, dp=dp)
    return [source.batch(i) for i in range(PEER_STEPS)]


def train_megazero(cfg, groups) -> dict:
    """megazero.training on these groups; losses, norms and this rank's full (TP-local) parameters."""
    from megazero.training import setup, train_step
    from megazero.zero.state_access import safe_get_full_fp32_param

    state = setup(cfg, groups)
    steps = [
        train_step(state, batch, peer_lr(done))
        for done, batch in enumerate(peer_batches(cfg, groups.coords.dp, groups.topology.dp))
    ]
    params = {
        name: (safe_get_full_fp32_param(p), param_info(p).tp_shard) for name, p in state.chunks[0].named_parameters()
    }
    return {
        "coords": tuple(groups.coords),
        "losses": [s.loss for s in steps],
        "norms": [s.grad_norm for s in steps],
        "params": params,
    }


def train_torch_peer(cfg, rank: int, kind: str) -> dict:
    """The same training under torch's DistributedDataParallel or FSDP2 (`fully_shard` on every
    layer, then the root, as its docs apply it), on the default 2-rank group."""
    import torch.distributed as dist

    adam = cfg.optimizer.adam
    model = plain_gpt(cfg.model, cfg.seed)
    if kind == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
        sync = lambda last: contextlib.nullcontext() if last else model.no_sync()  # noqa: E731
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (2,))
        for layer in model.layers.values():
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)

        @contextlib.contextmanager
        def sync(last):
            model.set_requires_gradient_sync(last)
            yield

    optimizer = adamw(model, adam.weight_decay, (adam.beta1, adam.beta2), adam.eps)
    losses, norms = torch_training(
        model,
        optimizer,
        peer_batches(cfg, rank, 2),
        world=2,
        sync=sync,
        tokens_per_step=cfg.global_batch_size * cfg.model.seq_length,
        clip=cfg.optimizer.clip_grad,
        lr_at=peer_lr,
    )
    total = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(total)
    module = model.module if kind == "ddp" else model
    params = {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in module.named_parameters()
    }
    return {"losses": total.tolist(), "norms": norms, "params": params}


def zero_and_torch_peers(ctx, stages) -> dict:
    """Pool entry (2 ranks): megazero at each ZeRO stage at dp 2, then DDP, then FSDP2."""
    import warnings
    from megazero.parallel.topology import Topology

    # Our GPT returns its per-token losses as a view; FSDP2 warns about in-place ops on it (none).
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    groups = ctx.groups(Topology(world_size=2))
    out = {f"ZeRO-{stage}": train_megazero(peer_config(stage), groups) for stage in stages}
    for kind in ("ddp", "fsdp2"):
        out[kind] = train_torch_peer(peer_config(), ctx.rank, kind)
    return out


def tp_worker(ctx) -> dict:
    from megazero.parallel.topology import Topology

    return train_megazero(peer_config(tp=2), ctx.groups(Topology(world_size=2, tp=2)))


def full_params(result: dict) -> dict:
    return {name: value for name, (value, _) in result["params"].items()}


def test_zero_stages_match_torch_ddp_and_fsdp2(dist_pool):
    """ZeRO 1 and 2 at dp 2 train as torch's DistributedDataParallel does, ZeRO 3 as FSDP2's
    fully_shard (and stage 0 as DDP), on the same GPT, init, data, AdamW with Megatron's decay
    groups, clip_grad_norm_ and lr: 5 steps, losses, gradient norms and final parameters within
    1e-6. Clipping bites on some of the steps.

    Kills: weight decay on biases and norm weights; clipping by the squared or the unsquared (L1)
    norm; no Adam bias correction in the C++ kernel."""
    results = dist_pool(2).run(zero_and_torch_peers, (0, 1, 2, 3))
    peers = {"ZeRO-0": "ddp", "ZeRO-1": "ddp", "ZeRO-2": "ddp", "ZeRO-3": "fsdp2"}
    cfg = peer_config()
    ddp = results[0]["ddp"]
    assert 1 <= sum(n > PEER_CLIP for n in ddp["norms"]) < PEER_STEPS, f"clipping must bite sometimes: {ddp['norms']}"
    for ours, kind in peers.items():
        for rank, per_rank in enumerate(results):
            peer, got, what = per_rank[kind], per_rank[ours], f"{ours} vs {kind} (rank {rank})"
            assert_same_losses(got["losses"], peer["losses"], f"{what}: loss")
            assert_same_losses(got["norms"], peer["norms"], f"{what}: grad norm")
            assert_same_params(
                without_key_bias(full_params(got), cfg.model),
                without_key_bias(peer["params"], cfg.model),
                f"{what}: final parameters",
            )
    assert_same_params(
        without_key_bias(results[0]["fsdp2"]["params"], cfg.model),
        without_key_bias(ddp["params"], cfg.model),
        "FSDP2 vs DDP (torch against itself)",
    )


def test_tensor_parallel_matches_the_single_device_model(dist_pool):
    """tp 2 (column/row-parallel layers, vocab-parallel embedding and loss) trains 5 steps as the
    single-device GPT of models/ driven by torch alone (AdamW, clip_grad_norm_, Megatron's decay
    groups): losses, norms and the assembled parameters within 1e-6.

    Kills: weight decay on biases and norm weights; clipping by the squared or unsquared norm; no
    Adam bias correction in the C++ kernel; a replicated parameter (a norm, a row-parallel bias)
    counted on both TP ranks in the gradient norm."""
    results = dist_pool(2).run(tp_worker)
    cfg = peer_config(tp=2)
    adam = cfg.optimizer.adam
    model = plain_gpt(cfg.model, cfg.seed)
    optimizer = adamw(model, adam.weight_decay, (adam.beta1, adam.beta2), adam.eps)
    losses, norms = torch_training(
        model,
        optimizer,
        peer_batches(cfg, 0, 1),
        lr_at=peer_lr,
        tokens_per_step=cfg.global_batch_size * cfg.model.seq_length,
        clip=cfg.optimizer.clip_grad,
    )
    expected = {n: p.detach() for n, p in model.named_parameters()}
    assert_same_losses(results[0]["losses"], losses, "tp 2: loss")
    assert_same_losses(results[0]["norms"], norms, "tp 2: grad norm")
    # The parameters at the project's exactness bar (1e-5), not the 1e-6 of the one-device layouts:
    # tp 2 sums row-parallel outputs and replicated norms' gradients in another order, and on one
    # machine (AMD EPYC) a single element of a norm bias, whose gradient is near zero so that Adam
    # normalises its noise, ended 2.1e-8 away (1.1e-6 of the tensor; every other element < 5e-9).
    # Losses and norms keep the 1e-6 bar (planted: weight decay on biases fails there, 4.75e-6 at step 3).
    assert_same_params(
        without_key_bias(assemble_params(results), cfg.model),
        without_key_bias(expected, cfg.model),
        "tp 2: final parameters",
        rtol=1e-5,
    )
