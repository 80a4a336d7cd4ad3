"""The mixture-of-experts flags: Megatron-LM's --num-experts and --moe-* names (and meanings), with
Megatron-DeepSpeed's --moe-expert-parallel-size, --topk, --moe-train-capacity-factor and
--moe-loss-coeff accepted where they mean the same, turned into GPTConfig's MoE fields. Part of the
edge: each bad combination is one UsageError before any process group.
"""

from __future__ import annotations

import ast

from megazero.core.errors import UsageError

# Megatron-DeepSpeed's flag -> the Megatron-LM flag it means here.
ALIASES = {
    "topk": "moe_router_topk",
    "moe_train_capacity_factor": "moe_expert_capacity_factor",
    "moe_loss_coeff": "moe_aux_loss_coeff",
    "moe_expert_parallel_size": "expert_model_parallel_size",
}


def add_moe_flags(g, add) -> None:
    """The flags of this module, added to argument group `g` with `add` (flags._add)."""
    add(g, "--num-experts", type=int, default=0, help="experts per MoE layer; 0: a dense model")
    add(g, "--moe-router-topk", type=int, default=None, help="experts each token goes to", shown=2)
    add(g, "--moe-ffn-hidden-size", type=int, default=0, help="each expert's width; 0: --ffn-hidden-size")
    add(
        g,
        "--moe-router-load-balancing-type",
        choices=["aux_loss", "seq_aux_loss", "none"],
        default="aux_loss",
        help="balancing loss: Switch's over the microbatch, per sequence, or none",
    )
    add(g, "--moe-aux-loss-coeff", type=float, default=None, help="the balancing loss's coefficient", shown=0.0)
    add(g, "--moe-z-loss-coeff", type=float, default=0.0, help="the router z-loss's coefficient (ST-MoE)")
    add(g, "--moe-router-score-function", choices=["softmax", "sigmoid"], default="softmax", help="router scores")
    add(
        g,
        "--moe-router-pre-softmax",
        action="store_true",
        help="softmax over all experts before the top-k (softmax scores)",
    )
    add(
        g,
        "--moe-router-topk-scaling-factor",
        type=float,
        default=None,
        help="multiply the top-k probabilities by this",
        shown="none",
    )
    add(
        g,
        "--moe-router-enable-expert-bias",
        action="store_true",
        help="DeepSeek-V3's aux-loss-free balancing: a per-expert bias in the choice (sigmoid scores)",
    )
    add(g, "--moe-router-bias-update-rate", type=float, default=1e-3, help="the expert bias's step per update")
    add(
        g,
        "--moe-router-dtype",
        choices=["fp32", "fp64"],
        default=None,
        help="the router GEMM's dtype",
        shown="the activations'",
    )
    add(
        g,
        "--moe-expert-capacity-factor",
        type=float,
        default=None,
        help="per sequence, an expert takes at most ceil(s x k x factor / experts) tokens",
        shown="dropless",
    )
    add(
        g,
        "--moe-pad-expert-input-to-capacity",
        action="store_true",
        help="every expert computes exactly its capacity (zero rows pad)",
    )
    add(
        g,
        "--moe-token-drop-policy",
        choices=["probs", "position"],
        default="probs",
        help="which tokens over capacity drop: the lowest probabilities or the latest positions",
    )
    add(
        g,
        "--moe-shared-expert-intermediate-size",
        type=int,
        default=0,
        help="width of the shared expert every token also goes through; 0: none",
    )
    add(
        g,
        "--moe-shared-expert-gate",
        action="store_true",
        help="scale the shared expert's output by sigmoid(x . w), a learned (1, hidden) gate per layer",
    )
    add(
        g,
        "--moe-layer-freq",
        default="1",
        help="every N-th layer MoE (from layer 0), or a Python list of 0/1 per layer, e.g. ([1]*3+[0])*2",
    )
    add(
        g,
        "--moe-grouped-gemm",
        action="store_true",
        help="the experts' GEMMs as one torch._grouped_mm where the device and dtype have it",
    )
    add(
        g,
        "--moe-token-dispatcher-type",
        choices=["alltoall", "allgather"],
        default="alltoall",
        help="how tokens reach the experts over the expert-parallel group",
    )
    add(
        g,
        "--expert-model-parallel-size",
        type=int,
        default=None,
        help="ranks the experts are split over, out of the data-parallel x context-parallel ranks "
        "(x the tensor-parallel ranks with --expert-tensor-parallel-size 1)",
        shown=1,
    )
    add(
        g,
        "--expert-tensor-parallel-size",
        type=int,
        default=None,
        help="tensor-parallel ranks of each expert: the tensor-parallel size, or 1 (whole experts; "
        "the expert groups then span the tensor-parallel ranks too)",
        shown="tp",
    )
    # Megatron-DeepSpeed's names (ALIASES)
    add(
        g,
        "--moe-expert-parallel-size",
        type=int,
        default=None,
        help="Megatron-DeepSpeed's --expert-model-parallel-size",
        shown="off",
    )
    add(g, "--topk", type=int, default=None, help="Megatron-DeepSpeed's --moe-router-topk", shown="off")
    add(
        g,
        "--moe-train-capacity-factor",
        type=float,
        default=None,
        help="Megatron-DeepSpeed's --moe-expert-capacity-factor",
        shown="off",
    )
    add(g, "--moe-loss-coeff", type=float, default=None, help="Megatron-DeepSpeed's --moe-aux-loss-coeff", shown="off")


def _merge_aliases(args) -> dict:
    """Megatron-LM's value of each aliased flag, checked against its Megatron-DeepSpeed twin."""
    values = {}
    for alias, name in ALIASES.items():
        mine, theirs = getattr(args, name, None), getattr(args, alias, None)
        if mine is not None and theirs is not None and mine != theirs:
            raise UsageError(
                f"--{alias.replace('_', '-')} {theirs} contradicts --{name.replace('_', '-')} "
                f"{mine} (the same setting); remove one"
            )
        values[name] = mine if mine is not None else theirs
    return values


def layer_freq(text: str):
    """--moe-layer-freq's value: an int, or a list expression of 0/1 (Megatron-LM's form)."""
    try:
        value = ast.literal_eval(text) if "*" not in text else _list_expression(text)
    except UsageError:
        raise
    except (ValueError, SyntaxError):
        raise UsageError(
            f"--moe-layer-freq {text!r} is neither an int nor a list of 0/1 such as ([1]*3+[0])*2"
        ) from None
    if isinstance(value, (tuple, list)):
        return [int(v) for v in value]
    if isinstance(value, int):
        return value
    raise UsageError(f"--moe-layer-freq {text!r} is neither an int nor a list of 0/1")


LAYER_PATTERN_LIMIT = 100_000  # entries of a --moe-layer-freq list: one per layer, far below this


def _list_expression(text: str):
    """Evaluates [..]*n + [..] expressions of int literals only (no names, no calls), refusing one
    longer than LAYER_PATTERN_LIMIT before building it (`[1]*9999999999999999999` would overflow or
    exhaust memory)."""

    def value(node):
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, (ast.List, ast.Tuple)):
            return [value(element) for element in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Add) and type(left) is type(right):
                return _bounded(
                    text, left + right if isinstance(left, int) else len(left) + len(right), lambda: left + right
                )
            if isinstance(node.op, ast.Mult):
                items, count = (left, right) if isinstance(left, list) else (right, left)
                if isinstance(items, list) and isinstance(count, int):
                    return _bounded(text, len(items) * max(count, 0), lambda: items * count)
                if isinstance(left, int) and isinstance(right, int):
                    return _bounded(text, left * right, lambda: left * right)
        raise ValueError(text)

    return value(ast.parse(text, mode="eval"))


def _bounded(text: str, size: int, build):
    if size > LAYER_PATTERN_LIMIT:
        raise UsageError(
            f"--moe-layer-freq {text!r} counts up to {size}, beyond any layer count; it needs one "
            f"0/1 per layer (as many as --num-layers), e.g. ([1]*3+[0])*2 for 8 layers"
        )
    return build()


def moe_fields(args) -> dict:
    """GPTConfig's MoE fields from the flags (empty for a dense model)."""
    merged = _merge_aliases(args)
    if not args.num_experts:
        given = [
            f"--{n.replace('_', '-')}"
            for n in ("moe_router_topk", "moe_aux_loss_coeff", "moe_expert_capacity_factor")
            if merged[n] is not None
        ]
        given += ["--moe-shared-expert-gate"] if args.moe_shared_expert_gate else []
        if given or (merged["expert_model_parallel_size"] or 1) > 1:
            flag = given[0] if given else "--expert-model-parallel-size"
            raise UsageError(f"{flag} needs --num-experts N (a mixture of experts); add it or remove {flag}")
        return {}
    topk = merged["moe_router_topk"]
    return dict(
        num_experts=args.num_experts,
        moe_router_topk=2 if topk is None else topk,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_router_load_balancing_type=args.moe_router_load_balancing_type,
        moe_aux_loss_coeff=merged["moe_aux_loss_coeff"] or 0.0,
        moe_z_loss_coeff=args.moe_z_loss_coeff,
        moe_router_score_function=args.moe_router_score_function,
        moe_router_pre_softmax=args.moe_router_pre_softmax,
        moe_router_topk_scaling_factor=args.moe_router_topk_scaling_factor,
        moe_router_enable_expert_bias=args.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=args.moe_router_bias_update_rate,
        moe_router_dtype=args.moe_router_dtype,
        moe_expert_capacity_factor=merged["moe_expert_capacity_factor"],
        moe_pad_expert_input_to_capacity=args.moe_pad_expert_input_to_capacity,
        moe_token_drop_policy=args.moe_token_drop_policy,
        moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=args.moe_shared_expert_gate,
        moe_layer_freq=layer_freq(args.moe_layer_freq),
        moe_grouped_gemm=args.moe_grouped_gemm,
    )


def expert_parallel_size(args) -> int:
    return _merge_aliases(args)["expert_model_parallel_size"] or 1
