"""Megatron-LM's precision-aware optimizer: `--use-precision-aware-optimizer` with
`--main-grads-dtype`, `--main-params-dtype`, `--exp-avg-dtype` and `--exp-avg-sq-dtype` (Megatron-LM's
names and choices), and DeepSpeed's `bf16.bf16_optimizer_states`, onto the precision record's
grad_accum_dtype, exp_avg_dtype and exp_avg_sq_dtype (megazero.zero.config.PrecisionConfig).

Owns these flags and the rules between them (torch-free; train_flags.py calls `optimizer_state_dtypes`
while it builds the precision record). Megatron-LM's rules kept: a dtype other than fp32 needs
--use-precision-aware-optimizer; the optimizer must be Adam; bf16 main gradients are the bf16 run's
gradient buffers (accumulated and, unless a setting says otherwise, reduced in bf16). Not kept:
Megatron-LM asks for its distributed optimizer, megazero takes the flag at every ZeRO stage (its
storage is one, stage 0 included). Choices Megatron-LM has that megazero refuses in one line until a
GPU run proves them: fp16 and fp8 moments (they need scaling to keep small values) and fp16 main
parameters (megazero's master weights stay fp32).
"""

from __future__ import annotations

from megazero.core.errors import UsageError

# setting -> (flag, Megatron-LM's choices, those megazero runs)
STATE_FLAGS = {
    "main_grads_dtype": ("--main-grads-dtype", ("fp32", "bf16"), ("fp32", "bf16")),
    "main_params_dtype": ("--main-params-dtype", ("fp32", "fp16"), ("fp32",)),
    "exp_avg_dtype": ("--exp-avg-dtype", ("fp32", "fp16", "bf16", "fp8"), ("fp32", "bf16")),
    "exp_avg_sq_dtype": ("--exp-avg-sq-dtype", ("fp32", "fp16", "bf16", "fp8"), ("fp32", "bf16")),
}
HELP = {
    "main_grads_dtype": "gradient buffers the optimizer reads (bf16 needs --bf16: accumulated and reduced in bf16)",
    "main_params_dtype": "master weights (megazero keeps them fp32)",
    "exp_avg_dtype": "Adam's first moment, stored (computed in fp32, rounded to nearest even)",
    "exp_avg_sq_dtype": "Adam's second moment, stored (computed in fp32, rounded to nearest even)",
}
NOT_YET = (
    "is not supported yet (megazero keeps Adam moments in fp32 or bf16 until a GPU run proves "
    "fp16/fp8 moments, which need scaling to keep small values); use bf16 or fp32"
)


def add_optimizer_state_flags(group, add) -> None:
    """The flags, on the parser's group `group` through flags.py's `add`."""
    add(
        group,
        "--use-precision-aware-optimizer",
        action="store_true",
        help="let the four dtype flags below keep optimizer tensors in lower precision (Megatron-LM's)",
    )
    for name, (flag, choices, _) in STATE_FLAGS.items():
        add(
            group,
            flag,
            choices=list(choices),
            default=None,
            shown="fp32",
            help=f"with --use-precision-aware-optimizer: dtype of the {HELP[name]}",
        )


def optimizer_state_dtypes(args, ds, run: str, merged: dict) -> dict[str, str]:
    """{"exp_avg_dtype", "exp_avg_sq_dtype"} of a `run` ("fp32", "bf16", "fp16") from the flags and
    DeepSpeed's bf16_optimizer_states (`ds`: the config's settings, or None); --main-grads-dtype goes
    into `merged` (train_flags' settings: grad_accum_dtype, and reduce_dtype unless given). A
    UsageError for what the rules refuse."""
    given = {name: getattr(args, name, None) for name in STATE_FLAGS}
    lowered = [name for name, value in given.items() if value not in (None, "fp32")]
    if lowered and not args.use_precision_aware_optimizer:
        flag = STATE_FLAGS[lowered[0]][0]
        raise UsageError(
            f"{flag} {given[lowered[0]]} needs --use-precision-aware-optimizer (Megatron-LM's "
            f"rule: without it every optimizer tensor is fp32); add it, or drop {flag}"
        )
    optimizer = getattr(args, "optimizer", None) or "adam"
    if args.use_precision_aware_optimizer and optimizer != "adam":
        raise UsageError(
            f"--use-precision-aware-optimizer works with Adam only (Megatron-LM's rule), not "
            f"--optimizer {optimizer}; drop one of them"
        )
    for name, value in given.items():
        flag, _, runs = STATE_FLAGS[name]
        if value is not None and value not in runs:
            why = (
                NOT_YET
                if name != "main_params_dtype"
                else "is not supported yet (megazero's master weights stay fp32); drop it"
            )
            raise UsageError(f"{flag} {value} {why}")
    out = {}
    for name in ("exp_avg_dtype", "exp_avg_sq_dtype"):
        from_json = ds.get(name) if ds else None
        if given[name] is not None and from_json is not None and given[name] != from_json:
            raise UsageError(
                f"{STATE_FLAGS[name][0]} {given[name]} contradicts {ds.source(name)} = true in "
                f"{args.zero_config}; remove one"
            )
        out[name] = given[name] or from_json or "fp32"
    if given["main_grads_dtype"] is not None:
        _main_grads(given["main_grads_dtype"], args, ds, run, merged)
    return out


def _main_grads(value: str, args, ds, run: str, merged: dict) -> None:
    """--main-grads-dtype: the gradient buffers' dtype (megazero's grad_accum_dtype). bf16, as in
    Megatron-LM (no fp32 accumulation and all-reduce), also reduces in bf16 unless a setting says
    how to reduce."""
    from_json = ds.get("grad_accum_dtype") if ds else None
    if from_json is not None and from_json != value:
        raise UsageError(
            f"--main-grads-dtype {value} contradicts {ds.source('grad_accum_dtype')} = "
            f'"{from_json}" in {args.zero_config}; remove one'
        )
    if value == "bf16" and run != "bf16":
        raise UsageError(
            f"--main-grads-dtype bf16 needs --bf16 (the gradients then accumulate in the "
            f"weights' dtype) but the run is {run}; add --bf16 or drop it"
        )
    merged["grad_accum_dtype"] = value
    reduce_given = args.reduce_dtype is not None or (ds is not None and "reduce_dtype" in ds.values)
    if value == "bf16" and not reduce_given:
        merged["reduce_dtype"] = "bf16"
