"""megazero against implementations it does not own: torch's training loop, DDP, FSDP2, GradScaler,
torch's FLOP counter, torch.distributed's own calls, the tensors actually alive.

The parity suites compare every layout with megazero's single-process run; they share its Adam,
clipping, weight-decay rule, lr schedule and loss code, so a bug in any of those passes them all.
Here the other side is written in the test from torch and from Megatron-LM's / DeepSpeed's
documented rules. Each test names, in its docstring, the bugs it was seen to catch (planted by hand,
one at a time; tests/README.md lists them all).
"""
from __future__ import annotations

import contextlib
import json
import math

import numpy as np
import pytest
import torch

from driver import run_main
from layouts import assemble_params, small_config, with_padded_vocab
from megazero.checkpoint.reader import CheckpointReader
from megazero.data.indexed_dataset import IndexedDatasetBuilder
from megazero.models.config import GPTConfig
from megazero.models.gpt import GPT, initial_value

RTOL = 1e-6


# --- rules written from Megatron-LM's documentation, not from megazero ---------------------------

def megatron_lr(steps_done: int, *, lr: float, min_lr: float, warmup: int, decay: int, style: str) -> float:
    """Megatron-LM's OptimizerParamScheduler.get_lr (lr_warmup_init 0), in iterations: the rate of the
    step taken after `steps_done` optimizer steps. Linear warmup from 0 over `warmup` steps; then
    constant, or a decay that reaches min_lr after `decay` steps and stays there."""
    if warmup > 0 and steps_done <= warmup:
        return lr * steps_done / warmup
    if style == "constant":
        return lr
    if steps_done > decay:
        return min_lr
    if style == "inverse-square-root":
        return max(min_lr, lr * math.sqrt(max(warmup, 1) / max(steps_done, 1)))
    progress = (steps_done - warmup) / (decay - warmup)
    if style == "linear":
        return min_lr + (lr - min_lr) * (1.0 - progress)
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def megatron_decays(name: str, param: torch.Tensor) -> bool:
    """Megatron-LM's default weight-decay rule (megatron/core/optimizer `_get_param_groups`): every
    parameter but biases and 1-D ones (norm scales). The word and position embeddings are 2-D, so
    they ARE decayed (GPT-2's and nanoGPT's rule is the same by dimension)."""
    return not (name.endswith(".bias") or param.ndim == 1)


def plain_gpt(cfg: GPTConfig, seed: int) -> GPT:
    """The pure single-device GPT of models/ with its layout-independent initial weights."""
    model = GPT(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():          # the tied embedding appears once
            p.copy_(initial_value(cfg, name, tuple(p.shape), seed))
    return model.train()


def adamw(model: torch.nn.Module, weight_decay: float, betas=(0.9, 0.999), eps=1e-8) -> torch.optim.AdamW:
    decay, rest = [], []
    for name, p in model.named_parameters():
        (decay if megatron_decays(name, p) else rest).append(p)
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=0.0, betas=betas, eps=eps)


def relative_gap(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30))


def without_key_bias(params: dict, cfg: GPTConfig) -> dict:
    """The parameters with the key part of each QKV bias left out. Softmax ignores a shift shared by
    a query's scores and q . (k_j + b) = q . k_j + q . b, so the key bias's exact gradient is 0: what
    it gets is rounding noise, which Adam normalises to steps of about lr whatever its size. Two
    correct implementations move it differently after their first differing bit; every other
    element follows a real gradient."""
    head = cfg.hidden_size // cfg.num_attention_heads
    per_group = cfg.num_attention_heads // cfg.num_query_groups      # query heads, then k, then v
    out = dict(params)
    for name, value in params.items():
        if name.endswith("attention.qkv.bias"):
            rows = value.reshape(cfg.num_query_groups, per_group + 2, head)
            out[name] = torch.cat([rows[:, :per_group], rows[:, per_group + 1:]], dim=1).flatten()
    return out


def assert_same_params(actual: dict, expected: dict, what: str, rtol: float = RTOL) -> None:
    """Per tensor, ||actual - expected|| <= rtol ||expected|| (L2; pass them through without_key_bias)."""
    assert actual.keys() == expected.keys(), f"{what}: parameter names differ"
    worst = max(expected, key=lambda n: relative_gap(actual[n], expected[n]))
    gap = relative_gap(actual[worst], expected[worst])
    assert gap <= rtol, f"{what}: {worst} differs by {gap:.2e} (relative L2; bound {rtol:g})"


def assert_same_losses(actual: list, expected: list, what: str, rtol: float = RTOL) -> None:
    assert len(actual) == len(expected), f"{what}: {len(actual)} losses vs {len(expected)}"
    for step, (a, b) in enumerate(zip(actual, expected), 1):
        assert abs(a - b) <= rtol * abs(b), f"{what}: step {step}: {a!r} vs {b!r} ({abs(a - b) / abs(b):.2e})"


# --- 1. pretrain_gpt.py, one process, fp32, against a plain torch loop --------------------------

TOKENS = 63                  # NullTokenizer ids 0..62; 63 is its end-of-document id
SEQ, MICRO, GLOBAL, STEPS, SEED = 32, 2, 4, 20, 1234
MODEL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=SEQ, hidden_dropout=0.0,
             attention_dropout=0.0)
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
        "--data-path", str(tmp_path / "corpus"), "--tokenizer-type", "NullTokenizer",
        "--vocab-size", str(TOKENS + 1), "--split", "100,0,0", "--seed", str(SEED),
        "--micro-batch-size", str(MICRO), "--global-batch-size", str(GLOBAL), "--train-iters", str(STEPS),
        "--lr", str(OPT["lr"]), "--min-lr", str(OPT["min_lr"]), "--lr-warmup-iters", str(OPT["warmup"]),
        "--lr-decay-iters", str(OPT["decay"]), "--lr-decay-style", style, "--clip-grad", str(OPT["clip"]),
        "--weight-decay", str(OPT["weight_decay"]), "--adam-beta1", str(OPT["betas"][0]),
        "--adam-beta2", str(OPT["betas"][1]), "--adam-eps", str(OPT["eps"]), "--eval-iters", "0", "--log-interval", "1",
        "--metrics-file", str(tmp_path / "metrics.jsonl"), "--save", str(tmp_path / "ck"),
        "--data-cache-path", str(tmp_path / "cache"), "--run-dir", str(tmp_path / "run")]


def torch_training(model, optimizer, batches, *, tokens_per_step: int, clip: float, lr_at, world: int = 1,
                   sync=lambda last: contextlib.nullcontext()) -> tuple[list, list]:
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


@pytest.mark.parametrize("style,adam", [("cosine", "kernel"), ("linear", "torch-adam"),
                                        ("inverse-square-root", "kernel")])
def test_pretrain_gpt_matches_a_plain_torch_training_loop(tmp_path, capsys, monkeypatch, style, adam):
    """`pretrain_gpt.py` (flags -> config -> engine -> training loop, in-process) trains 20 steps as
    torch.optim.AdamW + clip_grad_norm_ + Megatron's decay groups and lr schedule do: every loss and
    every final parameter (read back from its checkpoint) within 1e-6 relative.

    Kills: weight decay on biases and norm weights; clipping by the squared or the unsquared (L1)
    norm; the warmup one step late or early; cosine or linear decay over the wrong period;
    inverse-square-root not ending at min-lr; no Adam bias correction in the C++ kernel (cosine,
    inverse-square-root) or in megazero's torch reference Adam (linear, run with
    MEGAZERO_DISABLE_CPP_ADAM=1). The schedule counting skipped steps is test_fp16_*'s."""
    import megazero.training as training
    if adam == "torch-adam":           # megazero's torch reference Adam instead of the C++ kernel
        monkeypatch.setenv("MEGAZERO_DISABLE_CPP_ADAM", "1")
    write_corpus(tmp_path / "corpus")
    seen_at: dict[int, list[torch.Tensor]] = {}
    batch = training.MicrobatchSource.batch

    def recording(source, i):          # the tokens pretrain_gpt trains on, step by step
        out = batch(source, i)
        seen_at[i] = [t.clone() for t in out]    # by step: a read-ahead thread may fetch out of order
        return out

    monkeypatch.setattr(training.MicrobatchSource, "batch", recording)
    code, out = run_main(pretrain_argv(tmp_path, style), capsys)
    assert code == 0, out.err
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    seen = [seen_at[i] for i in sorted(seen_at)]
    assert sorted(seen_at) == list(range(STEPS)) and all(len(mbs) == GLOBAL // MICRO for mbs in seen)

    cfg = GPTConfig(vocab_size=TOKENS + 1, padded_vocab_size=128, **MODEL)
    model = plain_gpt(cfg, SEED)
    optimizer = adamw(model, OPT["weight_decay"], OPT["betas"], OPT["eps"])
    losses, norms = torch_training(
        model, optimizer, seen, tokens_per_step=GLOBAL * SEQ, clip=OPT["clip"],
        lr_at=lambda done: megatron_lr(done, lr=OPT["lr"], min_lr=OPT["min_lr"], warmup=OPT["warmup"],
                                       decay=OPT["decay"], style=style))
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
    """megazero.lr_schedule.learning_rate(cfg, n, train_iters), the rate of the n-th applied step,
    equals Megatron's rule after n - 1 steps for every step of several warmup / decay / length
    settings (decay_iters unset means train_iters, as Megatron's --lr-decay-iters), constant
    included, which no training test here runs."""
    from megazero.config.train_config import OptimizerConfig
    from megazero.lr_schedule import learning_rate
    for warmup, decay, train in [(0, None, 10), (3, None, 12), (4, 8, 12), (1, 2, 5), (5, 20, 30)]:
        cfg = OptimizerConfig(lr=3e-3, min_lr=3e-4, warmup_iters=warmup, decay_iters=decay, decay_style=style)
        for step in range(1, train + 1):
            expected = megatron_lr(step - 1, lr=3e-3, min_lr=3e-4, warmup=warmup, decay=decay or train, style=style)
            assert learning_rate(cfg, step, train) == pytest.approx(expected, rel=1e-12, abs=0.0), \
                (warmup, decay, train, step)


# --- 2. several ranks: ZeRO against DDP and FSDP2, TP against the single-device model ------------

PEER_STEPS, PEER_CLIP = 5, 1.1


def peer_config(stage: int = 0, tp: int = 1):
    """A 2-layer GPT, 2 microbatches per rank at dp 2, ZeRO buckets small enough to cut the model
    into several (stage 3: every unit partitioned)."""
    cfg = with_padded_vocab(small_config(tp=tp, stage=stage, steps=PEER_STEPS, layers=2, global_batch=8,
                                         clip=PEER_CLIP, lr=2e-3, zero_extra={"param_persistence_threshold": 0}))
    return cfg


def peer_lr(done: int) -> float:
    return megatron_lr(done, lr=2e-3, min_lr=2e-4, warmup=0, decay=PEER_STEPS, style="cosine")


def peer_batches(cfg, dp_rank: int, dp: int) -> list[list[torch.Tensor]]:
    from megazero.data.synthetic import ArithmeticTokens
    from megazero.training import MicrobatchSource
    source = MicrobatchSource(ArithmeticTokens(cfg.model.vocab_size, cfg.model.seq_length, seed=3),
                              cfg.global_batch_size, cfg.micro_batch_size, dp_rank, dp)
    return [source.batch(i) for i in range(PEER_STEPS)]


def train_megazero(cfg, groups) -> dict:
    """megazero.training on these groups; losses, norms and this rank's full (TP-local) parameters."""
    from megazero.training import setup, train_step
    from megazero.zero.state_access import safe_get_full_fp32_param
    state = setup(cfg, groups)
    steps = [train_step(state, batch, peer_lr(done))
             for done, batch in enumerate(peer_batches(cfg, groups.coords.dp, groups.topology.dp))]
    params = {name: (safe_get_full_fp32_param(p), getattr(p, "tp_shard", None))
              for name, p in state.chunks[0].named_parameters()}
    return {"coords": tuple(groups.coords), "losses": [s.loss for s in steps],
            "norms": [s.grad_norm for s in steps], "params": params}


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
    losses, norms = torch_training(model, optimizer, peer_batches(cfg, rank, 2), world=2, sync=sync,
                                   tokens_per_step=cfg.global_batch_size * cfg.model.seq_length,
                                   clip=cfg.optimizer.clip_grad, lr_at=peer_lr)
    total = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(total)
    module = model.module if kind == "ddp" else model
    params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
              for n, p in module.named_parameters()}
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
            assert_same_params(without_key_bias(full_params(got), cfg.model),
                               without_key_bias(peer["params"], cfg.model), f"{what}: final parameters")
    assert_same_params(without_key_bias(results[0]["fsdp2"]["params"], cfg.model),
                       without_key_bias(ddp["params"], cfg.model), "FSDP2 vs DDP (torch against itself)")


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
    losses, norms = torch_training(model, optimizer, peer_batches(cfg, 0, 1), lr_at=peer_lr,
                                   tokens_per_step=cfg.global_batch_size * cfg.model.seq_length,
                                   clip=cfg.optimizer.clip_grad)
    expected = {n: p.detach() for n, p in model.named_parameters()}
    assert_same_losses(results[0]["losses"], losses, "tp 2: loss")
    assert_same_losses(results[0]["norms"], norms, "tp 2: grad norm")
    assert_same_params(without_key_bias(assemble_params(results), cfg.model),
                       without_key_bias(expected, cfg.model), "tp 2: final parameters")


# --- 3. fp16: the dynamic loss scale against torch.amp.GradScaler and DeepSpeed's hysteresis -----

def grad_scaler_scales(overflows: list[bool], scale: float, window: int) -> list[float]:
    """torch.amp.GradScaler itself, fed an overflow pattern: the scale each step runs at."""
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale, growth_factor=2.0, backoff_factor=0.5,
                                  growth_interval=window)
    out = []
    for overflow in overflows:
        out.append(scaler.get_scale())
        scaler.scale(torch.ones(()))
        param.grad = torch.full((1,), math.inf if overflow else 1.0)
        scaler.step(optimizer)
        scaler.update()
    return out


def loss_scale_rules(overflows: list[bool], *, scale: float, window: int, hysteresis: int,
                     consecutive: bool, min_scale: float = 1.0) -> list[float]:
    """The scale each step runs at: GradScaler's rules (an inf/NaN step is skipped and backs the scale
    off by 2; `window` clean steps in a row grow it by 2, the count restarting at an overflow) with
    DeepSpeed's fp16.hysteresis: an overflow first uses up one of `hysteresis` tolerated overflows
    and only one that finds a single one left halves the scale, as does every later one until a
    growth refills them (with fp16.consecutive_hysteresis, every clean step refills them)."""
    out, tolerance, clean = [], hysteresis, 0
    for overflow in overflows:
        out.append(scale)
        if overflow:
            clean = 0
            if tolerance > 1:
                tolerance -= 1
            else:
                scale = max(scale / 2, min_scale)
            continue
        clean += 1
        if consecutive:
            tolerance = hysteresis
        if clean == window:
            scale, clean, tolerance = scale * 2, 0, hysteresis
    return out


class StepSnapshots:
    """A save policy that saves nothing: after every step it keeps copies of the fp16 weights, the
    fp32 master weights and the Adam moments."""

    def __init__(self, state):
        self.snapshots = [self.take(state)]

    @staticmethod
    def take(state) -> dict:
        from megazero.zero.state_access import safe_get_full_fp32_param, safe_get_full_optimizer_state
        params = dict(state.chunks[0].named_parameters())
        return {"fp16": {n: p.detach().clone() for n, p in params.items()},
                "fp32": {n: safe_get_full_fp32_param(p) for n, p in params.items()},
                "exp_avg": {n: safe_get_full_optimizer_state(p, "exp_avg") for n, p in params.items()},
                "exp_avg_sq": {n: safe_get_full_optimizer_state(p, "exp_avg_sq") for n, p in params.items()}}

    def stop_flags(self) -> tuple:
        return ()                         # no stop condition to agree on

    def after_step(self, state, consumed_samples, agreed=None):
        self.snapshots.append(self.take(state))

    def finish(self, state, consumed_samples):
        pass


def fp16_gradients_overflow(cfg, weights: dict, microbatches, scale: float) -> bool:
    """Whether the plain fp16 GPT with these weights gets a non-finite gradient from any microbatch
    of the loss scaled by `scale` (the summed token loss over the global batch's tokens, in fp32)."""
    model = GPT(cfg.model).to(torch.float16)
    model.load_state_dict(weights, strict=False)      # the tied head shares the embedding
    tokens_per_step = cfg.global_batch_size * cfg.model.seq_length
    for tokens in microbatches:
        model.zero_grad(set_to_none=True)
        loss = model(tokens[:, :-1], tokens[:, 1:]).float().sum() / tokens_per_step
        (loss * scale).backward()
        if not all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None):
            return True
    return False


@pytest.mark.parametrize("hysteresis", [1, 2])
def test_fp16_loss_scale_follows_grad_scaler_and_deepspeed_hysteresis(hysteresis):
    """An fp16 run (megazero.training.train, 1 process) that starts at a loss scale its gradients
    overflow at and grows back into it every 2 clean steps: a step is skipped exactly when the plain
    fp16 GPT, with that step's weights, gets an inf/NaN gradient at that scale; a skipped step leaves
    the master weights and Adam moments bit for bit; the scale each step runs at is GradScaler's
    (checked against torch.amp.GradScaler itself with hysteresis 1) with DeepSpeed's hysteresis; the
    lr schedule advances only on applied steps (Megatron's scheduler is stepped on success only).

    Kills: the loss scale never growing; every overflow halving (hysteresis ignored); a step
    applied despite an overflow; the lr schedule counting skipped steps; the warmup off by one;
    the decay over the wrong period."""
    from megazero.data.synthetic import ArithmeticTokens
    from megazero.parallel.groups import ProcessGroups
    from megazero.lr_schedule import learning_rate
    from megazero.training import MicrobatchSource, setup, train
    steps, power, window = 14, 21, 2
    cfg = with_padded_vocab(small_config(steps=steps, layers=2, global_batch=8, clip=1.0, lr=1e-3))
    prec = cfg.precision
    prec.fp16, prec.initial_scale_power, prec.loss_scale_window = True, power, window
    prec.hysteresis = hysteresis
    # The oracle is the plain fp16 GPT's fp16 gradients (GradScaler's and DeepSpeed's view); with
    # gradient-accumulation fusion the weight gradients are fp32 sums, which overflow later.
    prec.gradient_accumulation_fusion = False
    state = setup(cfg, ProcessGroups.single())
    source = MicrobatchSource(ArithmeticTokens(cfg.model.vocab_size, cfg.model.seq_length, seed=3),
                              cfg.global_batch_size, cfg.micro_batch_size, 0, 1)
    spy = StepSnapshots(state)
    records = train(state, source, [], lambda n, _samples: learning_rate(cfg.optimizer, n, steps), policy=spy)
    skipped = [r["skipped"] for r in records]
    scales = [r["loss_scale"] for r in records]

    overflows = [fp16_gradients_overflow(cfg, spy.snapshots[i]["fp16"], source.batch(i), scales[i])
                 for i in range(steps)]
    assert skipped == overflows, f"skipped steps {skipped} vs inf/NaN gradients {overflows}"
    grew = any(b > a for a, b in zip(scales, scales[1:]))
    assert sum(skipped) >= 3 and grew, f"the run must overflow and grow back: scales {scales}"

    expected = loss_scale_rules(overflows, scale=2.0 ** power, window=window, hysteresis=hysteresis,
                                consecutive=False)
    assert scales == expected, f"loss scales {scales}, rules {expected}"
    if hysteresis == 1:
        assert expected == grad_scaler_scales(overflows, 2.0 ** power, window)

    applied = 0
    for i, record in enumerate(records):
        before, after = spy.snapshots[i], spy.snapshots[i + 1]
        for kind in ("fp32", "exp_avg", "exp_avg_sq"):
            same = all(torch.equal(before[kind][n], after[kind][n]) for n in before[kind])
            kept = skipped[i] or (kind == "fp32" and record["lr"] == 0.0)   # warmup's first step
            assert same == kept, f"step {i + 1}: {kind} {'changed' if not same else 'kept'}"
        assert record["lr"] == pytest.approx(megatron_lr(applied, lr=1e-3, min_lr=1e-4, warmup=2, decay=steps,
                                                         style="cosine"), rel=1e-12), f"step {i + 1}"
        applied += not skipped[i]


@pytest.mark.parametrize("hysteresis,consecutive", [(1, False), (2, False), (2, True), (3, True)])
def test_loss_scaler_on_overflow_patterns(hysteresis, consecutive):
    """megazero's LossScaler against the rules above on 200 random overflow patterns, near the
    floor too (min scale 4); with hysteresis 1 also against torch.amp.GradScaler itself. Covers
    what one training run cannot choose: an overflow, a clean step, an overflow (consecutive
    hysteresis refills in between, the default does not).

    Kills: the loss scale never growing; growth after window + 1 clean steps; every overflow
    halving (hysteresis ignored); consecutive_hysteresis ignored."""
    from megazero.zero.loss_scaler import LossScaler
    rng = np.random.default_rng(hysteresis * 2 + consecutive)
    for _ in range(200):
        overflows = list(rng.random(int(rng.integers(1, 40))) < rng.uniform(0.1, 0.7))
        window = int(rng.integers(1, 5))
        scaler = LossScaler.for_fp16(initial_scale_power=5, window=window, hysteresis=hysteresis,
                                     min_loss_scale=4.0, consecutive_hysteresis=consecutive)
        scales = []
        for overflow in overflows:
            scales.append(scaler.scale)
            scaler.update(bool(overflow))
        expected = loss_scale_rules(overflows, scale=32.0, window=window, hysteresis=hysteresis,
                                    consecutive=consecutive, min_scale=4.0)
        assert scales == expected, (overflows, window, scales, expected)
        if hysteresis == 1:
            unfloored = loss_scale_rules(overflows, scale=32.0, window=window, hysteresis=1,
                                         consecutive=False, min_scale=0.0)
            assert unfloored == grad_scaler_scales(overflows, 32.0, window), (overflows, window)


# --- 4. accounting against independent measures ---------------------------------------------------

class WireTap:
    """torch.distributed's collectives wrapped while it is open: every call's process group (its
    global ranks) and the bytes of the tensors it was handed, per rank by the convention CommLog
    documents (ring algorithms: all-reduce 2(n-1)/n of the buffer, all-gather, reduce-scatter,
    all-to-all and broadcast (n-1)/n of the full buffer, point-to-point the tensor). megazero.core.comm
    binds the two collectives torch 2.13 renamed when it is imported; they are wrapped where it
    holds them too."""
    RING = {"all_reduce": ("all_reduce", "tensor", 2.0), "broadcast": ("broadcast", "tensor", 1.0),
            "all_gather_single": ("all_gather", "output_tensor", 1.0),
            "all_gather_into_tensor": ("all_gather", "output_tensor", 1.0),
            "reduce_scatter_single": ("reduce_scatter", "input", 1.0),
            "reduce_scatter_tensor": ("reduce_scatter", "input", 1.0),
            "all_to_all_single": ("all_to_all", "input", 1.0)}

    def __init__(self):
        import torch.distributed as dist
        import megazero.core.comm as comm
        self.bytes: dict[tuple[str, tuple], float] = {}
        self._undo = []
        for name in self.RING:
            if hasattr(dist, name):
                self._wrap(dist, name, getattr(dist, name))
        for alias in ("_all_gather_single", "_reduce_scatter_single"):
            original = getattr(comm, alias)
            self._wrap(comm, alias, original, original.__name__)
        self._wrap(dist, "batch_isend_irecv", dist.batch_isend_irecv)

    def _wrap(self, module, attr, original, name=None):
        import functools
        import inspect
        import torch.distributed as dist
        name = name or attr
        signature = inspect.signature(original)

        @functools.wraps(original)
        def counted(*args, **kwargs):
            bound = signature.bind(*args, **kwargs).arguments
            if name == "batch_isend_irecv":
                for op in bound["p2p_op_list"]:
                    kind = "send" if op.op.__name__ == "isend" else "recv"
                    self._add(kind, op.group, op.tensor.numel() * op.tensor.element_size())
            else:
                op, tensor_arg, factor = self.RING[name]
                group = bound.get("group")
                n = dist.get_world_size(group)
                tensor = bound[tensor_arg]
                self._add(op, group, factor * (n - 1) / n * tensor.numel() * tensor.element_size())
            return original(*args, **kwargs)

        setattr(module, attr, counted)
        self._undo.append((module, attr, original))

    def _add(self, op: str, group, nbytes: float) -> None:
        import torch.distributed as dist
        ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
        self.bytes[(op, ranks)] = self.bytes.get((op, ranks), 0.0) + nbytes

    def close(self) -> None:
        for module, attr, original in reversed(self._undo):
            setattr(module, attr, original)


def commlog_bytes(groups) -> dict[tuple[str, tuple], float]:
    """CommLog's whole-run byte counts, keyed like WireTap's: (op, the group's global ranks)."""
    out: dict[tuple[str, tuple], float] = {}
    for (op, kind, _), nbytes in groups.log.total_bytes.items():
        key = (op, tuple(getattr(groups, kind).ranks))
        out[key] = out.get(key, 0.0) + nbytes
    return out


def tapped_worker(ctx, layouts) -> list:
    """Pool entry: trains each (config, topology) 2 steps with torch.distributed tapped; returns
    per layout the tap's and CommLog's bytes."""
    from layouts import run_training
    out = []
    for cfg, topology in layouts:
        groups = ctx.groups(topology)
        tap = WireTap()
        try:
            run_training(cfg, groups)
        finally:
            tap.close()
        out.append((tap.bytes, commlog_bytes(groups)))
    return out


def test_comm_log_counts_what_torch_distributed_was_handed(dist_pool):
    """CommLog's bytes per op and group over whole runs (set-up included) equal the bytes of the
    tensors handed to torch.distributed's own collectives, counted by wrapping them: ZeRO-3 at dp 2
    with qwZ and qgZ (all-gather, reduce-scatter, all-to-all, all-reduce), tp 2 (all-reduce), pp 2
    1F1B with a tied embedding (send/recv, broadcast, all-reduce).

    Kills: an all-gather counted twice; a broadcast counted twice. (A collective that bypassed
    megazero.core.comm would show up as bytes CommLog lacks.)"""
    from megazero.parallel.topology import Topology
    zeropp = {"zero_quantized_weights": True, "zero_quantized_gradients": True}
    layouts = {
        "ZeRO-3 dp 2, qwZ + qgZ, 2 nodes": (small_config(stage=3, steps=2, layers=2, zero_extra=zeropp),
                                            Topology(world_size=2, ranks_per_node=1)),
        "tp 2": (small_config(tp=2, steps=2, layers=2), Topology(world_size=2, tp=2)),
        "pp 2 1F1B, ZeRO-1": (small_config(pp=2, stage=1, schedule="1f1b", steps=2, layers=2),
                              Topology(world_size=2, pp=2)),
    }
    results = dist_pool(2).run(tapped_worker, list(layouts.values()))
    ops = set()
    for rank, per_rank in enumerate(results):
        for what, (tapped, logged) in zip(layouts, per_rank):
            assert logged.keys() == tapped.keys(), f"{what} rank {rank}: {sorted(logged)} vs {sorted(tapped)}"
            for key, nbytes in tapped.items():
                assert logged[key] == pytest.approx(nbytes, rel=1e-12), f"{what} rank {rank}: {key}"
            ops.update(op for op, _ in tapped)
    assert ops == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send", "recv"}, ops


@pytest.mark.parametrize("activation,query_groups", [("gelu", 4), ("swiglu", 2)])
def test_step_flops_match_torch_flop_counter_on_the_math_attention_kernel(activation, query_groups):
    """megazero.flops' count of a training step (the MFU numerator) equals what torch's
    FlopCounterMode counts over a real forward and backward of the GPT, attention included: on the
    math SDPA backend attention runs as matmuls the counter sees (the CPU flash kernel it does not
    see). Causal attention is counted in full on both sides (the math kernel masks after the matmul).

    Kills: attention FLOPs halved for causality."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode
    from megazero.flops import forward_flops_per_token, step_flops
    # No vocabulary padding: flops.py counts the padded vocabulary (Megatron's convention) while the
    # fused loss multiplies only the real rows on one device.
    cfg = GPTConfig(vocab_size=128, padded_vocab_size=128, hidden_size=64, num_layers=2, num_attention_heads=4,
                    num_query_groups=query_groups, ffn_hidden_size=256, seq_length=32, hidden_dropout=0.0,
                    attention_dropout=0.0, activation=activation)
    model = plain_gpt(cfg, SEED)
    tokens = torch.randint(0, cfg.vocab_size, (3, cfg.seq_length + 1), generator=torch.Generator().manual_seed(0))
    count = tokens.shape[0] * cfg.seq_length
    with sdpa_kernel(SDPBackend.MATH):
        with FlopCounterMode(display=False) as forward:
            loss = model(tokens[:, :-1], tokens[:, 1:]).sum()
        with FlopCounterMode(display=False) as backward:
            loss.backward()
    assert forward.get_total_flops() == forward_flops_per_token(cfg) * count
    # The fused loss (models/loss.py) recomputes each chunk's logits in backward instead of keeping
    # them: one more output-layer matmul the hardware runs, outside the model FLOPs MFU counts.
    logits_again = 2 * count * cfg.hidden_size * cfg.padded_vocab_size
    assert forward.get_total_flops() + backward.get_total_flops() == step_flops(cfg, count) + logits_again


def live_tensor_bytes(root) -> int:
    """Bytes of the distinct tensor storages reachable from `root` (attributes, containers,
    closures: anything it keeps alive; not the globals of the modules its functions come from),
    except RNG states (the recompute function reaches the model's RNG tracker; they are not model
    states)."""
    import gc
    import types
    from megazero.parallel.random import RNGTracker
    skip = (str, bytes, int, float, bool, type(None), types.ModuleType, type, RNGTracker)
    seen, storages, stack = set(), {}, [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, skip):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.device.type != "meta":
                storage = obj.untyped_storage()
                storages[(storage.data_ptr(), str(obj.device))] = storage.nbytes()
            continue
        if isinstance(obj, types.FunctionType):    # its closure and defaults, not its module's globals
            for cell in obj.__closure__ or ():
                with contextlib.suppress(ValueError):          # an empty cell
                    stack.append(cell.cell_contents)
            stack.extend((obj.__defaults__, obj.__kwdefaults__))
            continue
        stack.extend(gc.get_referents(obj))
    return sum(storages.values())


def memory_worker(ctx, stage: int, bf16: bool) -> list:
    """Pool entry (2 ranks): 2 steps at ZeRO `stage`; at each step's peak of model states (gradients
    reduced, before the optimizer) the bytes alive under the engine and its memory report."""
    from megazero.data.synthetic import ArithmeticTokens
    from megazero.parallel.topology import Topology
    from megazero.training import MicrobatchSource, setup, train_step
    groups = ctx.groups(Topology(world_size=2))
    cfg = with_padded_vocab(small_config(stage=stage, steps=2, layers=2, bf16=bf16))
    state = setup(cfg, groups)
    engine, measured = state.engine, []
    step = engine.step

    def measuring_step(lr):
        engine.finish_gradients()
        measured.append((live_tensor_bytes(engine), engine.memory_report()))
        return step(lr)

    engine.step = measuring_step
    source = MicrobatchSource(ArithmeticTokens(cfg.model.vocab_size, cfg.model.seq_length, seed=3),
                              cfg.global_batch_size, cfg.micro_batch_size, groups.coords.dp, 2)
    for i in range(2):
        train_step(state, source.batch(i), 1e-3)
    return measured


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_memory_report_matches_the_tensors_alive(dist_pool, bf16):
    """The engine's memory report (model states + buffers + gathered parameters) equals the bytes
    of the tensors the engine keeps alive, found by walking everything reachable from it, at the
    peak of each step (gradients reduced, optimizer not yet run), ZeRO 0-3 at dp 2.

    At that moment and not between steps: ZeRO 2/3 free their gradient partitions' storage after
    the step, while the report still counts them (it gives the step's peak).

    Kills: an Adam moment left out of optimizer_states."""
    for stage in range(4):
        for rank, measured in enumerate(dist_pool(2).run(memory_worker, stage, bf16)):
            for i, (alive, report) in enumerate(measured):
                reported = report["model_states"] + report["buffers"] + report["live_params"]
                assert alive == reported, f"stage {stage} rank {rank} step {i + 1}: {alive} bytes alive, " \
                                          f"{reported} reported ({report})"
