"""Name, shape and config mapping between megazero's GPT and megatron-core's GPTModel (Megatron-LM's
checkpoints, both the legacy per-rank files and `--ckpt-format torch_dist`).

Owns: which GPTConfig a Megatron-LM argument record (the `args` every Megatron-LM checkpoint keeps)
describes and back, which options cannot be matched exactly (refused naming the flag), and how every
parameter maps, per layer, on full (tensor-parallel merged) tensors. Reading and writing files is
megazero/checkpoint/megatron_files.py's job; like the rest of `models`, this imports nothing of
megazero's outside `models`. Refusals are ConversionError (a ValueError).

Facts the mapping honours:
- megatron-core's fused linear_qkv runs query group by query group, [q heads of g, k_g, v_g], as
  megazero's qkv does: the weights map unchanged (and a TP shard holds whole groups of both).
- SwiGLU's linear_fc1 is [gate; up] in the full tensor, as megazero's fc1.
- Rotary layout: Megatron rotates halves of the rotated dims (x[i], x[i + r/2]) unless
  --rotary-interleaved; megazero rotates interleaved pairs (x[2i], x[2i+1]). The q and k rows of
  every head are permuted between the two (q.k is unchanged since both move alike).
- Norm names: the Transformer Engine spec fuses the layer norms into the next linear
  (`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`), the local spec keeps
  `input_layernorm` / `pre_mlp_layernorm`; both are read; torch_dist always uses the fused names.
- GELU: Megatron's fused bias-GELU (its default with biases) and --openai-gelu are the tanh form,
  its plain GELU the exact one; exports name the form with --openai-gelu, fusion off.
- A zero-centred norm (--apply-layernorm-1p) stores the offset weight on both sides.
"""

from __future__ import annotations

from typing import Callable

import torch

from .config import GPTConfig


class ConversionError(ValueError):
    """A model or argument record one side cannot express exactly; the message names the flag."""


# Megatron-LM arguments that change the model's function and that megazero has no match for.
_UNSUPPORTED = (
    ("qk_layernorm", False, "--qk-layernorm"),
    (
        "moe_shared_expert_intermediate_size",
        None,
        "--moe-shared-expert-intermediate-size (shared experts are not converted yet)",
    ),
    ("moe_router_enable_expert_bias", False, "--moe-router-enable-expert-bias (not converted yet)"),
    ("moe_input_jitter_eps", None, "--moe-input-jitter-eps"),
    ("multi_latent_attention", False, "--multi-latent-attention"),
    ("rotary_scaling_factor", 1.0, "--rotary-scaling-factor"),
    ("use_rope_scaling", False, "--use-rope-scaling"),
    ("squared_relu", False, "--squared-relu"),
    ("group_query_attention_in_fp32", False, "--group-query-attention-in-fp32"),
)


def gpt_config(args: dict) -> GPTConfig:
    """The GPTConfig of a Megatron-LM argument record; refuses options megazero cannot match."""
    for key, neutral, flag in _UNSUPPORTED:
        if args.get(key, neutral) not in (neutral, None, 0):
            raise ConversionError(
                f"the checkpoint was trained with {flag}, which megazero's GPT does not "
                f"have; it cannot be converted exactly"
            )
    tp, etp = args.get("tensor_model_parallel_size") or 1, args.get("expert_tensor_parallel_size")
    if args.get("num_experts") and etp not in (None, tp):
        raise ConversionError(
            f"--expert-tensor-parallel-size {etp} with --tensor-model-parallel-size {tp}: "
            f"megazero merges experts split as the dense layers are; convert a checkpoint "
            f"saved with equal degrees"
        )
    position = args.get("position_embedding_type", "learned_absolute")
    if position not in ("learned_absolute", "rope"):
        raise ConversionError(f"--position-embedding-type {position}: megazero has learned_absolute and rope")
    heads = args["num_attention_heads"]
    groups = args.get("num_query_groups") if args.get("group_query_attention") else heads
    padded = args.get("padded_vocab_size") or args["vocab_size"]
    seq = args.get("seq_length") or args.get("max_position_embeddings")
    # Megatron's fused bias-GELU (on by default; validate_args turns it off without biases) and
    # --openai-gelu compute the tanh form; plain GELU is torch's exact erf form
    tanh = args.get("openai_gelu") or (args.get("bias_gelu_fusion", True) and args.get("add_bias_linear", True))
    return GPTConfig(
        vocab_size=padded,
        hidden_size=args["hidden_size"],
        num_layers=args["num_layers"],
        num_attention_heads=heads,
        num_query_groups=groups or heads,
        kv_channels=args.get("kv_channels") or 0,
        ffn_hidden_size=args.get("ffn_hidden_size") or 0,
        seq_length=seq,
        max_position_embeddings=args.get("max_position_embeddings") or seq,
        position_embedding="rope" if position == "rope" else "learned",
        rotary_base=float(args.get("rotary_base", 10000)),
        rotary_percent=float(args.get("rotary_percent", 1.0)),
        activation="swiglu" if args.get("swiglu") else "gelu",
        gelu_approximate="tanh" if tanh else "none",
        normalization="rmsnorm" if args.get("normalization", "LayerNorm") == "RMSNorm" else "layernorm",
        norm_epsilon=args.get("norm_epsilon", 1e-5),
        apply_layernorm_1p=bool(args.get("apply_layernorm_1p")),
        tie_embeddings=not args.get("untie_embeddings_and_output_weights", False),
        add_bias_linear=args.get("add_bias_linear", True),
        add_qkv_bias=bool(args.get("add_qkv_bias")),
        hidden_dropout=args.get("hidden_dropout", 0.1),
        attention_dropout=args.get("attention_dropout", 0.1),
        init_method_std=args.get("init_method_std", 0.02),
        **_moe_fields(args),
    )


# Megatron-LM's MoE arguments megazero's GPTConfig takes under the same names, with Megatron-LM's defaults
_MOE_FIELDS = {
    "moe_router_topk": 2,
    "moe_router_load_balancing_type": "aux_loss",
    "moe_aux_loss_coeff": 0.0,
    "moe_z_loss_coeff": None,
    "moe_router_score_function": "softmax",
    "moe_router_pre_softmax": False,
    "moe_router_topk_scaling_factor": None,
    "moe_router_dtype": None,
    "moe_expert_capacity_factor": None,
    "moe_pad_expert_input_to_capacity": False,
    "moe_token_drop_policy": "probs",
    "moe_layer_freq": 1,
}


def _moe_fields(args: dict) -> dict:
    """GPTConfig's mixture-of-experts fields of a Megatron-LM argument record ({} for a dense model)."""
    if not args.get("num_experts"):
        return {}
    fields = {key: args.get(key, default) for key, default in _MOE_FIELDS.items()}
    fields["moe_z_loss_coeff"] = fields["moe_z_loss_coeff"] or 0.0
    return dict(
        fields,
        num_experts=args["num_experts"],
        moe_ffn_hidden_size=args.get("moe_ffn_hidden_size") or args.get("ffn_hidden_size") or 0,
    )


def _moe_args(config: GPTConfig) -> dict:
    """The --moe-* arguments of `config`'s mixture of experts ({} for a dense model); refuses what
    the export does not write (megatron-core stacks every layer's experts on one layer axis)."""
    if not config.num_experts:
        return {}
    if not all(config.is_moe_layer(i) for i in range(config.num_layers)):
        raise ConversionError(
            f"--moe-layer-freq {config.moe_layer_freq}: export-megatron writes mixtures of experts in every layer only"
        )
    if config.moe_shared_expert_intermediate_size or config.moe_router_enable_expert_bias:
        raise ConversionError(
            "--moe-shared-expert-intermediate-size / --moe-router-enable-expert-bias: "
            "export-megatron does not write shared experts or expert biases yet"
        )
    fields = {key: getattr(config, key) for key in _MOE_FIELDS}
    return dict(
        fields, num_experts=config.num_experts, moe_ffn_hidden_size=config.moe_ffn_hidden_size, moe_grouped_gemm=False
    )


def megatron_args(config: GPTConfig, rotary_interleaved: bool = False) -> dict:
    """The Megatron-LM arguments that rebuild `config`'s model (names of megatron/training/arguments.py)."""
    return dict(
        **_moe_args(config),
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        group_query_attention=config.num_query_groups != config.num_attention_heads,
        num_query_groups=config.num_query_groups,
        kv_channels=config.head_dim,
        ffn_hidden_size=config.ffn_hidden_size,
        seq_length=config.seq_length,
        max_position_embeddings=config.max_position_embeddings,
        vocab_size=config.vocab_size,
        padded_vocab_size=config.padded_vocab_size,
        position_embedding_type="rope" if config.position_embedding == "rope" else "learned_absolute",
        rotary_base=config.rotary_base,
        rotary_percent=config.rotary_percent,
        rotary_interleaved=rotary_interleaved,
        swiglu=config.activation == "swiglu",
        bias_gelu_fusion=False,
        openai_gelu=config.activation == "gelu" and config.gelu_approximate == "tanh",
        normalization="RMSNorm" if config.normalization == "rmsnorm" else "LayerNorm",
        norm_epsilon=config.norm_epsilon,
        apply_layernorm_1p=config.apply_layernorm_1p,
        untie_embeddings_and_output_weights=not config.tie_embeddings,
        add_bias_linear=config.add_bias_linear,
        add_qkv_bias=config.add_qkv_bias,
        hidden_dropout=config.hidden_dropout,
        attention_dropout=config.attention_dropout,
        init_method_std=config.init_method_std,
    )


def _rotary_rows(config: GPTConfig, t: torch.Tensor, to_megatron: bool) -> torch.Tensor:
    """Reorders the q and k rows of every head of a fused qkv tensor between megazero's interleaved
    rotary pairs and Megatron's halves; v rows and unrotated dims stay."""
    d, r = config.head_dim, config.rotary_dim
    order = torch.arange(d, device=t.device)
    order[:r] = torch.cat([torch.arange(0, r, 2, device=t.device), torch.arange(1, r, 2, device=t.device)])
    if not to_megatron:
        order = torch.argsort(order)
    per_group = config.num_attention_heads // config.num_query_groups + 2
    heads = t.unflatten(0, (config.num_query_groups, per_group, d)).clone()
    heads[:, :-1] = heads[:, :-1, order]  # q heads and k; not v
    return heads.flatten(0, 2).contiguous()


Entry = tuple[str, str, Callable, Callable]  # ours, theirs, ours -> theirs, theirs -> ours


def _layer_map(config: GPTConfig, i: int, rotary_interleaved: bool) -> list[Entry]:
    ours, theirs = f"layers.{i}.", f"decoder.layers.{i}."
    same = (lambda t: t), (lambda t: t)
    qkv = same
    if config.position_embedding == "rope" and not rotary_interleaved:
        qkv = (lambda t: _rotary_rows(config, t, True)), (lambda t: _rotary_rows(config, t, False))
    norm = ["weight"] + (["bias"] if config.normalization == "layernorm" else [])
    linear = ["weight"] + (["bias"] if config.add_bias_linear else [])
    entries = [(f"{ours}input_norm.{k}", f"{theirs}self_attention.linear_qkv.layer_norm_{k}", *same) for k in norm]
    # a mixture of experts keeps its norm apart in both specs (local_spec_name's name) but torch_dist
    # names it as the fused one
    entries += [(f"{ours}mlp_norm.{k}", f"{theirs}mlp.linear_fc1.layer_norm_{k}", *same) for k in norm]
    qkv_keys = ["weight"] + (["bias"] if config.add_bias_linear or config.add_qkv_bias else [])
    entries += [(f"{ours}attention.qkv.{k}", f"{theirs}self_attention.linear_qkv.{k}", *qkv) for k in qkv_keys]
    entries += [(f"{ours}attention.proj.{k}", f"{theirs}self_attention.linear_proj.{k}", *same) for k in linear]
    if config.is_moe_layer(i):
        return entries + [(f"{ours}mlp.router.weight", f"{theirs}mlp.router.weight", *same)]
    entries += [(f"{ours}mlp.fc1.{k}", f"{theirs}mlp.linear_fc1.{k}", *same) for k in linear]
    entries += [(f"{ours}mlp.fc2.{k}", f"{theirs}mlp.linear_fc2.{k}", *same) for k in linear]
    return entries


def expert_names(config: GPTConfig, i: int, projection: str) -> list[str]:
    """megatron-core's per-expert names (local spec's SequentialMLP, global expert numbers) of layer
    i's linear_fc1 or linear_fc2 weights."""
    return [f"decoder.layers.{i}.mlp.experts.local_experts.{e}.{projection}.weight" for e in range(config.num_experts)]


def _split_experts(t: torch.Tensor) -> list[torch.Tensor]:
    return [w.t().contiguous() for w in t.unbind(0)]


def _join_experts(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([w.t() for w in tensors]).contiguous()


def _expert_entries(config: GPTConfig) -> list[tuple[str, list[str], Callable, Callable]]:
    """Each MoE layer's experts: megazero's weight1 (E, h, 2f: [gate | up]) and weight2 (E, f, h) are
    megatron-core's per-expert linear_fc1 (2f, h: [gate; up] rows) and linear_fc2 (h, f) weights
    transposed and stacked: (ours, their names, ours -> theirs, theirs -> ours)."""
    if config.add_bias_linear:
        raise ConversionError("experts with linear biases (no --disable-bias-linear): megazero's experts have none")
    return [
        (f"layers.{i}.mlp.experts.weight{n}", expert_names(config, i, projection), _split_experts, _join_experts)
        for i in range(config.num_layers)
        if config.is_moe_layer(i)
        for n, projection in ((1, "linear_fc1"), (2, "linear_fc2"))
    ]


def parameter_map(config: GPTConfig, rotary_interleaved: bool = False) -> list[Entry]:
    """Every megazero parameter with its megatron-core name (Transformer Engine spec) and conversions."""
    same = (lambda t: t), (lambda t: t)
    entries = [("embedding.word.weight", "embedding.word_embeddings.weight", *same)]
    if config.position_embedding == "learned":
        entries.append(("embedding.position.weight", "embedding.position_embeddings.weight", *same))
    for i in range(config.num_layers):
        entries += _layer_map(config, i, rotary_interleaved)
    norm = ["weight"] + (["bias"] if config.normalization == "layernorm" else [])
    entries += [(f"final_norm.{k}", f"decoder.final_layernorm.{k}", *same) for k in norm]
    if not config.tie_embeddings:
        entries.append(("output_head.weight", "output_layer.weight", *same))
    return entries


def local_spec_name(name: str) -> str:
    """The local (non Transformer Engine) spec's name for a fused-norm parameter name."""
    return name.replace("self_attention.linear_qkv.layer_norm_", "input_layernorm.").replace(
        "mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm."
    )


def from_megatron(config: GPTConfig, state: dict, rotary_interleaved: bool = False) -> dict:
    """megazero's full parameters from a megatron-core GPTModel state dict of full tensors (either spec)."""
    out = {}
    for ours, theirs, _, join in _expert_entries(config) if config.num_experts else []:
        missing = [name for name in theirs if name not in state]
        if missing:
            raise ConversionError(
                f"the checkpoint has no {missing[0]}; megazero reads megatron-core's local-spec "
                f"experts (SequentialMLP, not --moe-grouped-gemm) of the number its arguments give"
            )
        out[ours] = join([state[name].to(torch.float32) for name in theirs])
    for ours, theirs, _, back in parameter_map(config, rotary_interleaved):
        tensor = state.get(theirs, state.get(local_spec_name(theirs)))
        if tensor is None:
            raise ConversionError(
                f"the checkpoint has no {theirs} (nor {local_spec_name(theirs)}); it is not "
                f"a GPT of the shape its arguments describe"
            )
        out[ours] = back(tensor.to(torch.float32))
    return out


def to_megatron(config: GPTConfig, read: Callable[[str], torch.Tensor], rotary_interleaved: bool = False) -> dict:
    """megatron-core's full state dict (Transformer Engine names; experts one by one, global numbers)
    from `read(our name)`."""
    out = {theirs: there(read(ours)) for ours, theirs, there, _ in parameter_map(config, rotary_interleaved)}
    for ours, theirs, split, _ in _expert_entries(config) if config.num_experts else []:
        out.update(zip(theirs, split(read(ours))))
    return out


# Adam's states as megazero names them, from megatron-core's distributed optimizer's
MEGATRON_STATES = {"param": "fp32", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")


def optimizer_from_megatron(config: GPTConfig, states: dict, rotary_interleaved: bool = False) -> dict:
    """megazero's {fp32 | exp_avg | exp_avg_sq: {name: full tensor}} from megatron-core's distributed
    optimizer states ({param | exp_avg | exp_avg_sq: {megatron-core name: full tensor}}); the
    mapping is the weights' (pure reorderings, so it holds for the moments too)."""
    return {
        MEGATRON_STATES[kind]: from_megatron(config, tensors, rotary_interleaved) for kind, tensors in states.items()
    }


def schedule(args: dict, progress: dict) -> dict:
    """OptimizerConfig's fields (lr schedule, Adam, clipping) of a Megatron-LM run, from its argument
    record and its scheduler's saved state; refuses what megazero's schedule cannot follow exactly."""
    sched = progress.get("scheduler") or {}
    style = sched.get("lr_decay_style", args.get("lr_decay_style", "linear"))
    if style not in _DECAY_STYLES:
        raise ConversionError(f"--lr-decay-style {style}: megazero's schedule has {', '.join(_DECAY_STYLES)}")
    if args.get("lr_warmup_init"):
        raise ConversionError(f"--lr-warmup-init {args['lr_warmup_init']}: megazero's warmup starts at 0")
    start_wd, end_wd = (
        sched.get("start_wd", args.get("weight_decay", 0.01)),
        sched.get("end_wd", args.get("weight_decay", 0.01)),
    )
    if start_wd != end_wd and sched.get("wd_incr_style", "constant") != "constant":
        raise ConversionError(
            f"--start-weight-decay {start_wd} --end-weight-decay {end_wd}: megazero's weight decay is constant"
        )
    batch = args.get("global_batch_size") or 1
    warmup, decay = int(sched.get("lr_warmup_steps", 0)), int(sched.get("lr_decay_steps", 0))
    # Megatron counts the schedule in samples; megazero in iterations unless the batch size ramps
    in_samples = bool(args.get("rampup_batch_size")) or warmup % batch != 0 or decay % batch != 0
    unit = 1 if in_samples else batch
    adam = {
        "weight_decay": float(start_wd),
        "lr": float(sched.get("max_lr", args.get("lr") or 0.0)),
        **progress.get("adam", {}),
    }
    return {
        "lr": float(sched.get("max_lr", args.get("lr") or 0.0)),
        "min_lr": float(sched.get("min_lr", args.get("min_lr", 0.0))),
        "warmup_iters": warmup // unit,
        "decay_iters": decay // unit or None,
        "decay_style": style,
        "adam": adam,
        "clip_grad": float(args.get("clip_grad", 1.0)),
        "in_samples": in_samples,
        "decoupled_lr": args.get("decoupled_lr"),
        "decoupled_min_lr": args.get("decoupled_min_lr"),
    }


def megatron_progress(optimizer: dict, progress: dict) -> dict:
    """What Megatron-LM keeps of a run to continue it: its arguments (schedule, Adam, batch, consumed
    samples), `opt_param_scheduler`'s state (in samples) and the distributed optimizer's param
    groups (one per weight-decay multiplier and decoupled-lr flag, as megatron-core matches them),
    from megazero's OptimizerConfig record and `progress` (step_count, consumed_samples,
    train_iters, global_batch_size)."""
    batch, train_iters = progress["global_batch_size"], progress["train_iters"]
    unit = 1 if optimizer.get("in_samples") else batch
    adam = optimizer.get("adam", {})
    args = dict(
        train_iters=train_iters,
        global_batch_size=batch,
        consumed_train_samples=progress["consumed_samples"],
        lr=optimizer["lr"],
        min_lr=optimizer["min_lr"],
        lr_decay_style=optimizer["decay_style"],
        lr_warmup_iters=optimizer["warmup_iters"],
        lr_decay_iters=optimizer.get("decay_iters") or train_iters,
        weight_decay=adam.get("weight_decay", 0.01),
        start_weight_decay=adam.get("weight_decay", 0.01),
        end_weight_decay=adam.get("weight_decay", 0.01),
        weight_decay_incr_style="constant",
        clip_grad=optimizer.get("clip_grad", 1.0),
        adam_beta1=adam.get("beta1", 0.9),
        adam_beta2=adam.get("beta2", 0.999),
        adam_eps=adam.get("eps", 1e-8),
        optimizer="adam",
        use_distributed_optimizer=True,
        decoupled_lr=optimizer.get("decoupled_lr"),
        decoupled_min_lr=optimizer.get("decoupled_min_lr"),
        ckpt_format="torch_dist",
        dist_ckpt_optim_fully_reshardable=True,
    )
    decay = (optimizer.get("decay_iters") or train_iters) * unit
    scheduler = dict(
        max_lr=optimizer["lr"],
        min_lr=optimizer["min_lr"],
        lr_warmup_steps=optimizer["warmup_iters"] * unit,
        num_steps=progress["consumed_samples"] if unit == 1 else progress["step_count"] * batch,
        lr_decay_style=optimizer["decay_style"],
        lr_decay_steps=decay,
        start_wd=args["weight_decay"],
        end_wd=args["weight_decay"],
        wd_incr_style="constant",
        wd_incr_steps=train_iters * batch,
    )
    group = dict(
        lr_mult=1.0,
        is_expert_parallel=False,
        betas=(args["adam_beta1"], args["adam_beta2"]),
        eps=args["adam_eps"],
        amsgrad=False,
        maximize=False,
        foreach=None,
        capturable=False,
        differentiable=False,
        fused=None,
        decoupled_weight_decay=True,
        step=float(progress["step_count"]),
        max_lr=optimizer["lr"],
        min_lr=optimizer["min_lr"],
        lr=optimizer["lr"],
    )
    groups = [
        dict(
            group,
            wd_mult=wd_mult,
            weight_decay=args["weight_decay"] * wd_mult,
            is_decoupled_lr=decoupled,
            default_config=True,
        )
        for decoupled in (False, True)
        for wd_mult in (1.0, 0.0)
    ]
    # a mixture of experts' second (chained) optimizer: the same groups over the expert parameters
    experts = [dict(g, is_expert_parallel=True) for g in groups]
    return {"args": args, "opt_param_scheduler": scheduler, "param_groups": groups, "expert_param_groups": experts}
