"""The Muon flags: Megatron-LM's --optimizer muon and --muon-* names (and meanings), and DeepSpeed's
"optimizer": {"type": "Muon"} block, turned into OptimizerConfig.muon. Part of the edge: each bad value
or combination is one UsageError before any process group.

DeepSpeed's Muon (deepspeed/runtime/zero/muon) has no keys for most of what Megatron-LM's flags set:
its implementation fixes them (Nesterov momentum, the update scaled by sqrt(max(1, rows / cols)), the
coefficients (3.4445, -4.775, 2.0315), bf16 iterations, QKV orthogonalised whole, momentum 0.95 by
default). A run whose optimizer comes from such a block takes those as its defaults; a --muon-* flag
given on the command line still wins (a DeepSpeed key and a flag that disagree are refused, as for
every setting both may give).
"""

from __future__ import annotations

from megazero.config.deepspeed_blocks import as_bool, as_number
from megazero.core.errors import UsageError
from megazero.ops.muon_config import COEFFICIENT_TYPES, MATMUL_PRECISIONS, SCALE_MODES, MuonConfig

# Megatron-LM's values these flags also take, which megazero does not have (yet): value -> why.
NOT_YET = {
    "muon_coefficient_type": {"polar_express": "", "cans": "", "aol": "", "deepseekv4": "", "custom": "", "cubic5": ""},
    "muon_fp32_matmul_prec": {"low": "torch has no 'low' float32 matmul precision"},
    "muon_tp_mode": {
        "blockwise": "it orthogonalises each tensor-parallel shard apart, so the update depends "
        "on the layout; megazero orthogonalises every matrix whole"
    },
    "muon_scalar_optimizer": {"lion": ""},
}
# What DeepSpeed's Muon implies where it has no key (see the module docstring).
DEEPSPEED_MUON = dict(
    momentum=0.95,
    nesterov=True,
    scale_mode="shape_scaling",
    coefficient_type="simple",
    split_qkv=False,
    matmul_precision="medium",
)
DEEPSPEED_PARAMS = {
    "lr",
    "momentum",
    "weight_decay",
    "betas",
    "eps",
    "ns_method",
    "muon_lr",
    "adam_lr",
    "adam_w_mode",
    "per_head_muon",
}


def add_muon_flags(g, add) -> None:
    """The flags of this module, added to argument group `g` with `add` (flags._add)."""
    add(
        g,
        "--optimizer",
        choices=["adam", "muon"],
        default=None,
        type=_optimizer_name,
        help="adam: Adam(W) for every parameter; muon (or Megatron-LM's dist_muon, the same updates): Muon for "
        "the weight matrices, AdamW for the embeddings, output layer, norms, biases and MoE router; a "
        "DeepSpeed config may set it instead",
        shown="adam",
    )
    add(
        g,
        "--muon-momentum",
        type=float,
        default=None,
        help="Muon's momentum, in [0, 1)",
        shown="0.9; DeepSpeed's Muon: 0.95",
    )
    add(
        g,
        "--muon-use-nesterov",
        "--muon-nesterov",
        dest="muon_nesterov",
        action="store_true",
        default=None,
        help="Nesterov momentum in Muon",
        shown="off; DeepSpeed's Muon: on",
    )
    add(g, "--muon-num-ns-steps", type=int, default=None, help="Newton-Schulz iterations, in [1, 100)", shown=5)
    add(
        g,
        "--muon-coefficient-type",
        default=None,
        help="Newton-Schulz coefficients: quintic (five tuned sets, cycled) or simple (3.4445, -4.775, 2.0315: "
        "torch.optim.Muon's)",
        shown="quintic; DeepSpeed's Muon: simple",
    )
    add(
        g,
        "--muon-scale-mode",
        default=None,
        help="the update's factor from the matrix's shape: spectral sqrt(max(rows, cols)), unit_rms_norm "
        "sqrt(rows / cols) or shape_scaling sqrt(max(1, rows / cols))",
        shown="spectral; DeepSpeed's Muon: shape_scaling",
    )
    add(g, "--muon-extra-scale-factor", type=float, default=None, help="a further factor on the update, > 0", shown=1.0)
    add(
        g,
        "--muon-fp32-matmul-prec",
        default=None,
        help="medium: Newton-Schulz in bf16 (torch.optim.Muon's); high: in fp32 (layout-invariant to fp32 rounding)",
        shown="medium",
    )
    add(
        g,
        "--muon-no-split-qkv",
        dest="muon_split_qkv",
        action="store_false",
        default=None,
        help="orthogonalise the QKV weight whole instead of its queries, keys and values apart",
        shown="split; DeepSpeed's Muon: whole",
    )
    add(
        g,
        "--muon-tp-mode",
        default=None,
        help="accepted as duplicated or distributed: megazero gathers each tensor-parallel matrix whole on one "
        "owner rank (the same result)",
        shown="duplicated",
    )
    add(g, "--muon-scalar-optimizer", default=None, help="what steps the parameters Muon does not: adam", shown="adam")


def _optimizer_name(value: str) -> str:
    """Megatron-LM's dist_muon shards Muon's work layer by layer over the data-parallel ranks; here
    every matrix has an owner rank anyway, so it is muon."""
    return "muon" if value == "dist_muon" else value


def _choice(args, name: str, allowed, default: str) -> str:
    value = getattr(args, name)
    if value is None:
        return default
    flag = "--" + name.replace("_", "-")
    if value in NOT_YET.get(name, {}):
        why = NOT_YET[name][value]
        raise UsageError(f"{flag} {value} is not supported yet{f' ({why})' if why else ''}; use {' or '.join(allowed)}")
    if value not in allowed:
        raise UsageError(f"{flag} {value!r} is not a choice; use {' or '.join(allowed)}")
    return value


def muon_config(args, ds, merged: dict) -> MuonConfig | None:
    """The run's Muon settings (None: --optimizer adam), flags over a DeepSpeed Muon block's defaults."""
    given = [
        f"--{n.replace('_', '-')}".replace("-muon-nesterov", "-muon-use-nesterov")
        for n in (
            "muon_nesterov",
            "muon_num_ns_steps",
            "muon_coefficient_type",
            "muon_scale_mode",
            "muon_extra_scale_factor",
            "muon_fp32_matmul_prec",
            "muon_tp_mode",
            "muon_scalar_optimizer",
        )
        if getattr(args, n) is not None
    ]
    given += ["--muon-no-split-qkv"] if args.muon_split_qkv is not None else []
    given += ["--muon-momentum"] if merged["muon_momentum"] is not None else []
    if merged["optimizer"] != "muon":
        if given:
            raise UsageError(f"{given[0]} needs --optimizer muon (megazero's optimizer is Adam otherwise)")
        return None
    base = MuonConfig(**DEEPSPEED_MUON) if ds is not None and ds.get("optimizer") == "muon" else MuonConfig()
    momentum = base.momentum if merged["muon_momentum"] is None else merged["muon_momentum"]
    if not 0 <= momentum < 1:
        raise UsageError(f"--muon-momentum must be in [0, 1), got {momentum}")
    steps = base.ns_steps if args.muon_num_ns_steps is None else args.muon_num_ns_steps
    if not 1 <= steps < 100:
        raise UsageError(f"--muon-num-ns-steps must be in [1, 100), got {steps}")
    extra = base.extra_scale_factor if args.muon_extra_scale_factor is None else args.muon_extra_scale_factor
    if not extra > 0:
        raise UsageError(f"--muon-extra-scale-factor must be > 0, got {extra}")
    _choice(args, "muon_tp_mode", ("duplicated", "distributed"), "duplicated")
    _choice(args, "muon_scalar_optimizer", ("adam",), "adam")
    return MuonConfig(
        momentum=momentum,
        nesterov=base.nesterov if args.muon_nesterov is None else True,
        ns_steps=steps,
        coefficient_type=_choice(args, "muon_coefficient_type", COEFFICIENT_TYPES, base.coefficient_type),
        scale_mode=_choice(args, "muon_scale_mode", SCALE_MODES, base.scale_mode),
        extra_scale_factor=extra,
        matmul_precision=_choice(args, "muon_fp32_matmul_prec", MATMUL_PRECISIONS, base.matmul_precision),
        split_qkv=base.split_qkv if args.muon_split_qkv is None else args.muon_split_qkv,
    )


def check_muon(muon: MuonConfig | None, zero, tp: int, tp_mode: str | None) -> list[str]:
    """Combinations with other settings Muon does not take, and the notes a run gets."""
    if muon is None:
        return []
    if zero.zenflow is not None:
        raise UsageError(
            "--optimizer muon with zero_optimization.zenflow is not supported (ZenFlow selects "
            "the columns Adam steps on the device); drop one of them"
        )
    if tp > 1 and tp_mode is None:  # never silent: a Megatron-LM recipe would run blockwise
        return [
            "--optimizer muon with tensor parallelism: each matrix is orthogonalised whole (Megatron-LM's "
            "--muon-tp-mode duplicated); Megatron-LM's default, blockwise, orthogonalises each shard apart"
        ]
    return []


def read_deepspeed_muon(params: dict, where: str, put: dict, notes: list[str]) -> None:
    """optimizer.params of a DeepSpeed "Muon" block (its keys not shared with Adam's) into `put`."""
    put["optimizer"] = ("muon", "optimizer.type")
    if "momentum" in params:
        put["muon_momentum"] = (
            float(as_number(params["momentum"], "optimizer.params.momentum", where)),
            "optimizer.params.momentum",
        )
    for key in ("muon_lr", "adam_lr"):
        if key in params:
            value = float(as_number(params[key], f"optimizer.params.{key}", where))
            if "lr" not in params or value != float(params["lr"]):
                raise UsageError(
                    f"{where}: optimizer.params.{key} = {value} is not supported yet: Muon's and "
                    f"Adam's parameters follow one lr schedule; set optimizer.params.lr instead"
                )
    if as_bool(params.get("per_head_muon", False), "optimizer.params.per_head_muon", where):
        raise UsageError(
            f"{where}: optimizer.params.per_head_muon = true is not supported yet; remove it "
            f"(megazero orthogonalises each weight matrix whole, Q, K and V apart with --optimizer "
            f"muon's default split)"
        )
    method = params.get("ns_method", "gram")
    if method not in ("gram", "standard"):
        raise UsageError(f'{where}: optimizer.params.ns_method must be "gram" or "standard", got {method!r}')
    gram = ' (DeepSpeed\'s "gram" is the same polynomial, its products in another order)' if method == "gram" else ""
    notes.append(
        f"{where}: optimizer.type Muon runs DeepSpeed's Muon (Nesterov, momentum 0.95 unless "
        f"optimizer.params.momentum, scale sqrt(max(1, rows / cols)), coefficients (3.4445, -4.775, "
        f"2.0315), bf16, QKV whole) on megazero's matrices (the router and embeddings take AdamW), its "
        f"Newton-Schulz the standard iteration{gram}; --muon-* flags change the rest"
    )
