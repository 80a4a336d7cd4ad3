"""Shared helpers of the megazero.initialize tests: tiny transformers models (Llama, GPT-2, Mixtral;
dropout off, fp32), their token batches, the plain single-process torch loop they are compared with
(torch.optim.AdamW on every parameter, clip_grad_norm_), and the pool worker that trains the same model
through megazero.initialize under a DeepSpeed config.

The global batch of a step is split over ranks and micro batches; each micro batch has the same
token count, so the mean of the micro losses is the global batch's mean loss. The reference
accumulates the same micro batches' gradients (loss / their count) in one process: a different split
(one forward of the whole batch) moves Llama's parameters by 1.6e-7 relative, measured, far inside
the bar, but GPT-2's key bias by 4e-5: its exact gradient is 0 (softmax ignores a shift shared by a
query's scores), so Adam moves it by normalised rounding noise whatever the implementation, and its
key third is left out of the parameter comparison (docs/design.md, the correctness contract).
"""

from __future__ import annotations

import torch

VOCAB, SEQ, MICRO, ACCUMULATION, STEPS = 64, 8, 1, 2, 10
LR, WEIGHT_DECAY, CLIP, SEED = 1e-3, 0.1, 0.3, 11
RTOL = 1e-5


def tiny_model(kind: str, seed: int = SEED, **extra):
    """A tiny `kind` model ("llama", "gpt2", "mixtral"; "tiled": TiledLM, "experts": ExpertsLM)
    built with torch's generator at `seed`."""
    torch.manual_seed(seed)
    if kind == "tiled":
        return TiledLM()
    if kind == "experts":
        return ExpertsLM()
    return kind_class(kind)(tiny_config(kind, **extra))


class Gate(torch.nn.Module):
    """A gated two-layer block of a user's model (a stage-3 leaf when set_z3_leaf_modules marks it)."""

    def __init__(self, width: int):
        super().__init__()
        self.up, self.gate, self.down = (torch.nn.Linear(width, width) for _ in range(3))

    def forward(self, x):
        return self.down(self.up(x) * torch.sigmoid(self.gate(x)))


class TiledLM(torch.nn.Module):
    """A user's own language model: an embedding, megazero.zero.TiledLinear (2 x 3 tiles, initialised
    here: the tiles are torch.empty), a Gate block, an output layer; kwargs-only forward, `.loss`."""

    def __init__(self, width: int = 24):
        super().__init__()
        from megazero.zero import TiledLinear

        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.tiled = TiledLinear(16, width, bias=True, in_splits=2, out_splits=3)
        for p in self.tiled.parameters():
            torch.nn.init.normal_(p, std=0.2)
        self.block = Gate(width)
        self.head = torch.nn.Linear(width, VOCAB)

    def forward(self, input_ids, labels):
        import types

        logits = self.head(self.block(torch.tanh(self.tiled(self.embed(input_ids)))))
        return types.SimpleNamespace(loss=torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()))


def kind_class(kind: str):
    import transformers as tf

    return {"llama": tf.LlamaForCausalLM, "gpt2": tf.GPT2LMHeadModel, "mixtral": tf.MixtralForCausalLM}[kind]


def tiny_config(kind: str, **extra):
    import transformers as tf

    if kind == "gpt2":
        return tf.GPT2Config(
            vocab_size=VOCAB,
            n_positions=SEQ,
            n_embd=16,
            n_layer=2,
            n_head=2,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **extra,
        )
    shape = dict(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=SEQ,
        attention_dropout=0.0,
        **extra,
    )
    if kind == "llama":
        return tf.LlamaConfig(**shape)
    return tf.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **shape)


class Experts(torch.nn.Module):
    """A mixture-of-experts block as many users write it (and transformers did before its fused
    experts): a router, one module per expert, top-1, an expert that gets no token is not run."""

    def __init__(self, width: int, count: int = 4):
        super().__init__()
        self.router = torch.nn.Linear(width, count, bias=False)
        self.experts = torch.nn.ModuleList(Gate(width) for _ in range(count))

    def forward(self, x):
        flat = x.flatten(0, -2)
        weight, choice = torch.softmax(self.router(flat), dim=-1).max(dim=-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows = (choice == e).nonzero().flatten()
            if rows.numel():
                out = out.index_add(0, rows, expert(flat[rows]) * weight[rows, None])
        return out.view_as(x)


class ExpertsLM(torch.nn.Module):
    """A user's own language model around an Experts block; kwargs-only forward, `.loss`."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, width)
        self.moe = Experts(width)
        self.head = torch.nn.Linear(width, VOCAB)

    def forward(self, input_ids, labels):
        import types

        x = self.embed(input_ids)
        logits = self.head(x + self.moe(x))
        return types.SimpleNamespace(loss=torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()))


def global_batches(dp: int, steps: int = STEPS, seed: int = 3, skew: bool = False) -> list[torch.Tensor]:
    """`skew`: data-parallel rank 0's rows hold one token repeated, so every token of its micro
    batches takes the same experts (a mixture-of-experts model's others get none there)."""
    g = torch.Generator().manual_seed(seed)
    batches = [torch.randint(0, VOCAB, (MICRO * ACCUMULATION * dp, SEQ), generator=g) for _ in range(steps)]
    for batch in batches if skew else []:
        for m in range(ACCUMULATION):
            micro_batch(batch, 0, dp, m).fill_(7)
    return batches


def micro_batch(batch: torch.Tensor, dp_rank: int, dp: int, micro: int) -> torch.Tensor:
    row = (micro * dp + dp_rank) * MICRO
    return batch[row : row + MICRO]


def ds_config(stage: int, **zero) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": ACCUMULATION,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
        "zero_optimization": {
            "stage": stage,
            "stage3_param_persistence_threshold": 16,
            "reduce_bucket_size": 2000,
            "stage3_prefetch_bucket_size": 4000,
            **zero,
        },
    }


def torch_reference(kind: str, dp: int, steps: int = STEPS, skew: bool = False) -> dict:
    """The plain loop: the whole global batch, AdamW on every parameter, clip_grad_norm_."""
    model = tiny_model(kind)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    losses, norms = [], []
    for batch in global_batches(dp, steps, skew=skew):
        total = 0.0
        for m in range(ACCUMULATION):
            for r in range(dp):
                tokens = micro_batch(batch, r, dp, m)
                loss = model(input_ids=tokens, labels=tokens).loss / (ACCUMULATION * dp)
                loss.backward()
                total += loss.item()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return {"losses": losses, "norms": norms, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def client_optimizer(model):
    """The torch optimizer a user passes as optimizer= (the config then has no optimizer block)."""
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)


def client_config(stage: int, **zero) -> dict:
    """ds_config without its optimizer block, for a run given client_optimizer."""
    config = ds_config(stage, **zero)
    del config["optimizer"]
    return config


def train_with_megazero(
    ctx,
    kind: str,
    dp: int,
    config: dict,
    *,
    topology_extra=None,
    build=None,
    steps: int = STEPS,
    client: bool = False,
    skew: bool = False,
) -> dict | None:
    """Pool entry: the first `dp` ranks train `kind` through megazero.initialize; rank 0 returns the
    global losses and the full final parameters. `build()` makes the model (default tiny_model);
    `client`: the model's torch AdamW given as optimizer= (the config without an optimizer block);
    `skew`: global_batches'."""
    import megazero
    from megazero.parallel.topology import Topology
    from megazero.utils import safe_get_full_fp32_param

    zero = config["zero_optimization"]
    groups = ctx.groups(
        Topology(
            world_size=dp,
            mics_shard_size=zero.get("mics_shard_size", -1),
            hpz_partition_size=zero.get("zero_hpz_partition_size", 1),
            **(topology_extra or {}),
        )
    )
    if groups is None:
        return None
    model = build() if build is not None else tiny_model(kind)
    optimizer = client_optimizer(model) if client else None
    engine, *_ = megazero.initialize(model=model, config=config, optimizer=optimizer, process_groups=groups)
    losses, norms = train_loop(engine, dp, groups.dp.rank, groups.dp.pg, steps, skew)
    params = {n: safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters()}
    return (
        {"losses": losses, "norms": norms, "params": params, "steps": engine.global_steps} if groups.rank == 0 else None
    )


def train_with_deepspeed(ctx, kind: str, config: dict, steps: int = STEPS) -> dict | None:
    """Pool entry: DeepSpeed's own engine (deepspeed.initialize on its CPU accelerator, every pool
    rank data parallel) trains `kind` with client_optimizer and `config` (no optimizer block: its
    Adam types are JIT-built extensions); rank 0 returns what train_with_megazero does."""
    import os

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ["LOCAL_RANK"] = str(ctx.rank)  # one machine: the launcher would set it
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    model = tiny_model(kind)
    config = {**config, "zero_allow_untested_optimizer": True, "steps_per_print": 2**31}
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=client_optimizer(model), config=config, dist_init_required=False
    )
    losses, norms = train_loop(engine, ctx.world_size, ctx.rank, None, steps)
    params = {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}
    return {"losses": losses, "norms": norms, "params": params, "steps": engine.global_steps} if ctx.rank == 0 else None


def train_loop(engine, dp: int, dp_rank: int, dp_pg, steps: int, skew: bool = False) -> tuple[list[float], list[float]]:
    """DeepSpeed's loop: engine(batch), engine.backward(loss), engine.step() per micro batch; the
    global batch's mean loss and the gradient norm before clipping (get_global_grad_norm) of every step."""
    losses, norms = [], []
    for batch in global_batches(dp, steps, skew=skew):
        total = torch.zeros(1, dtype=torch.float64)
        for m in range(ACCUMULATION):
            tokens = micro_batch(batch, dp_rank, dp, m)
            loss = engine(input_ids=tokens, labels=tokens).loss
            engine.backward(loss)
            engine.step()
            total += loss.item() / (ACCUMULATION * dp)
        torch.distributed.all_reduce(total, group=dp_pg)
        losses.append(total.item())
        norms.append(float(engine.get_global_grad_norm()))
    return losses, norms


def assert_matches(result: dict, reference: dict, what: str, rtol: float = RTOL) -> None:
    got, want = torch.tensor(result["losses"]), torch.tensor(reference["losses"])
    torch.testing.assert_close(got, want, rtol=rtol, atol=0, msg=lambda m: f"{what}: losses\n{m}")
    # the gradient norm before clipping: clipping and Adam hide a gradient's scale from the weights
    got, want = torch.tensor(result["norms"]), torch.tensor(reference["norms"])
    torch.testing.assert_close(got, want, rtol=rtol, atol=0, msg=lambda m: f"{what}: gradient norms\n{m}")
    for name, value in reference["params"].items():
        mine = result["params"][name]
        if name.endswith("attn.c_attn.bias"):  # GPT-2's key bias third: see the docstring
            third = value.numel() // 3
            value, mine = torch.cat([value[:third], value[2 * third :]]), torch.cat([mine[:third], mine[2 * third :]])
        gap = ((mine - value).norm() / value.norm()).item()
        assert gap <= rtol, f"{what}: parameter {name} off by {gap:.2e} (relative L2)"
