"""The ZeRO settings of a run: the DeepSpeed config's zero_optimization block merged with the flags.

Owns the mapping of the ZeRO flags (--zero-stage, Megatron's --use-distributed-optimizer and
--overlap-*, the offload and ZeRO++ flags) onto a ZeroConfig, and the checks of those settings
against the rank grid (hpZ and the hierarchical gather need shard groups laid out evenly over the
nodes). A flag and a config key that both say something must agree; the error names both.
"""

from __future__ import annotations

from megazero.core.errors import UsageError
from megazero.parallel.topology import Topology
from megazero.zero.config import ZeroConfig, as_json, check_stage_features

# flag attribute -> (ZeroConfig field, the flag's spelling)
_ZEROPP_FLAGS = {
    "zero_hpz_partition_size": ("zero_hpz_partition_size", "--zero-hpz-partition-size"),
    "zero_quantized_weights": ("zero_quantized_weights", "--zero-quantized-weights"),
    "zero_quantized_gradients": ("zero_quantized_gradients", "--zero-quantized-gradients"),
    "zero_hierarchical_gather": ("mics_hierarchical_params_gather", "--zero-hierarchical-gather"),
    "zero_stage3_granularity": ("stage3_granularity", "--zero-stage3-granularity"),
    "zero_sub_group_size": ("sub_group_size", "--zero-sub-group-size"),
    "cpu_optimizer_threads": ("cpu_optimizer_threads", "--cpu-optimizer-threads"),
}


def add_zero_flags(group, add) -> None:
    """The offload and ZeRO++ flags (`add` is flags._add: it records each flag's shown default)."""
    add(
        group,
        "--zero-offload-optimizer",
        choices=["none", "cpu", "nvme"],
        default=None,
        help="fp32 master and Adam states in host memory or in files (zero_optimization.offload_optimizer)",
        shown="none",
    )
    add(
        group,
        "--optimizer-cpu-offload",
        action="store_true",
        help="Megatron-LM's name for --zero-offload-optimizer cpu",
    )
    add(
        group,
        "--zero-offload-param",
        choices=["none", "cpu", "nvme"],
        default=None,
        help="stage 3: parameter partitions in host memory or in files (zero_optimization.offload_param)",
        shown="none",
    )
    add(
        group,
        "--zero-nvme-path",
        default=None,
        metavar="DIR",
        help="directory for the nvme offload swap files",
        shown="none",
    )
    add(
        group,
        "--zero-sub-group-size",
        type=int,
        default=None,
        help="optimizer elements stepped (and swapped) at a time",
        shown="1e9",
    )
    add(
        group,
        "--cpu-optimizer-threads",
        type=int,
        default=None,
        help="threads of the offloaded optimizer's CPU Adam (also MEGAZERO_CPU_OPTIMIZER_THREADS)",
        shown="cores per local rank",
    )
    add(
        group,
        "--zero-hpz-partition-size",
        type=int,
        default=None,
        help="stage 3 hpZ: secondary partition over this many ranks of a node",
        shown="1 (off)",
    )
    add(
        group,
        "--zero-quantized-weights",
        action="store_true",
        default=None,
        help="stage 3 qwZ: int8 weights in the forward all-gather",
    )
    add(
        group,
        "--zero-quantized-gradients",
        action="store_true",
        default=None,
        help="stage 3 qgZ: quantized all-to-all gradient reduction, node first",
    )
    add(
        group,
        "--zero-hierarchical-gather",
        action="store_true",
        default=None,
        help="stage 3: gathers across nodes in two hops (mics_hierarchical_params_gather)",
    )
    add(
        group,
        "--zero-stage3-granularity",
        choices=["module", "layer"],
        default=None,
        help="stage 3 units: per module, or per transformer layer",
        shown="module",
    )


def zero_config(args, ds) -> tuple[ZeroConfig, list[str]]:
    """ZeRO settings from the config and the flags, with Megatron's spellings mapped onto them."""
    zero = ds.zero if ds else ZeroConfig()
    stage_in_json = ds is not None and "stage" in zero.model_fields_set
    if args.zero_stage is not None:
        if stage_in_json and zero.stage != args.zero_stage:
            raise UsageError(
                f"--zero-stage {args.zero_stage} contradicts zero_optimization.stage = "
                f"{zero.stage} in {args.zero_config}; remove one"
            )
        zero = zero.replace(stage=args.zero_stage)
    if args.use_distributed_optimizer:  # Megatron's distributed optimizer is ZeRO-1
        if args.zero_stage is None and not stage_in_json:
            zero = zero.replace(stage=1)
        elif zero.stage == 0:
            origin = (
                "--zero-stage 0"
                if args.zero_stage is not None
                else f"zero_optimization.stage = 0 in {args.zero_config}"
            )
            raise UsageError(f"--use-distributed-optimizer (ZeRO-1) contradicts {origin}; remove one")
    if args.overlap_grad_reduce:
        if zero.overlap_comm is False:
            raise UsageError(
                f"--overlap-grad-reduce contradicts zero_optimization.overlap_comm = false "
                f"in {args.zero_config}; remove one"
            )
        zero = zero.replace(overlap_comm=True)
    notes = []
    if args.overlap_param_gather and zero.stage < 3:
        notes.append(
            f"--overlap-param-gather has no effect at ZeRO stage {zero.stage}: updated parameters "
            f"are all-gathered right after the optimizer step (stage 3 prefetches them)"
        )
    elif args.overlap_param_gather and zero.prefetch_bucket_size == 0:
        raise UsageError(
            f"--overlap-param-gather contradicts stage3_prefetch_bucket_size = 0 in {args.zero_config}; remove one"
        )
    zero, spelled = _offload_flags(args, zero)
    for attr, (field, flag) in _ZEROPP_FLAGS.items():
        zero = _merge_flag(args, zero, getattr(args, attr), field, flag)
        if getattr(args, attr) is not None:
            spelled[field] = flag
    check_stage_features(zero, f"{args.zero_config}: zero_optimization", spelled)
    return zero, notes


def _merge_flag(args, zero: ZeroConfig, value, field: str, flag: str) -> ZeroConfig:
    if value is None:
        return zero
    if field in zero.model_fields_set and getattr(zero, field) != value:
        raise UsageError(
            f"{flag} {value} contradicts zero_optimization.{field} = "
            f"{as_json(getattr(zero, field))} in {args.zero_config}; remove one"
        )
    return zero.replace(**{field: value})


def _offload_flags(args, zero: ZeroConfig) -> tuple[ZeroConfig, dict[str, str]]:
    """--zero-offload-optimizer / --optimizer-cpu-offload / --zero-offload-param / --zero-nvme-path
    become the offload blocks (the config's other keys of a block stay)."""
    optimizer = args.zero_offload_optimizer
    spelled = (
        {
            "offload_optimizer": "--optimizer-cpu-offload"
            if args.optimizer_cpu_offload
            else f"--zero-offload-optimizer {optimizer}"
        }
        if optimizer or args.optimizer_cpu_offload
        else {}
    )
    if args.zero_offload_param:
        spelled["offload_param"] = f"--zero-offload-param {args.zero_offload_param}"
    if args.optimizer_cpu_offload:
        if optimizer not in (None, "cpu"):
            raise UsageError(f"--optimizer-cpu-offload contradicts --zero-offload-optimizer {optimizer}; remove one")
        optimizer = "cpu"
    for key, device in (("offload_optimizer", optimizer), ("offload_param", args.zero_offload_param)):
        block = getattr(zero, key)
        if device is not None:
            if block is not None and block.device != device and key in zero.model_fields_set:
                raise UsageError(
                    f"--zero-{key.replace('_', '-')} {device} contradicts "
                    f"zero_optimization.{key}.device = {as_json(block.device)} in "
                    f"{args.zero_config}; remove one"
                )
            block = (block or type(zero).model_fields[key].annotation.__args__[0]()).replace(device=device)
        if args.zero_nvme_path and block is not None and block.device == "nvme":
            block = block.replace(nvme_path=args.zero_nvme_path)
        zero = zero.replace(**{key: block})
    if (
        args.zero_nvme_path
        and not (zero.offload_optimizer and zero.offload_optimizer.device == "nvme")
        and not (zero.offload_param and zero.offload_param.device == "nvme")
    ):
        raise UsageError(
            "--zero-nvme-path is only used with nvme offload; add --zero-offload-optimizer "
            "nvme or --zero-offload-param nvme, or remove it"
        )
    return zero, spelled


def check_zero_layout(zero: ZeroConfig, topology: Topology) -> None:
    """hpZ and the hierarchical gather split each stage-3 shard group by node: every node must hold
    the same number of its ranks, and hpZ's partition must divide that number."""
    if zero.stage != 3 or (
        zero.zero_hpz_partition_size == 1
        and not zero.mics_hierarchical_params_gather
        and not zero.zero_quantized_gradients
    ):
        return
    for ranks in topology.mics_shard_groups():
        per_node: dict[int, int] = {}
        for r in ranks:
            per_node[topology.node_of(r)] = per_node.get(topology.node_of(r), 0) + 1
        counts = set(per_node.values())
        if len(counts) != 1:
            raise UsageError(
                f"stage-3 shard group {ranks} has {sorted(per_node.values())} ranks on its "
                f"{len(per_node)} nodes (ranks_per_node {topology.ranks_per_node}); the "
                f"hierarchical gather, hpZ and qgZ need the same count on every node: "
                f"change --ranks-per-node or mics_shard_size"
            )
        local = counts.pop()
        hpz = zero.zero_hpz_partition_size
        if hpz > 1 and local % hpz:
            raise UsageError(
                f"zero_hpz_partition_size {hpz} must divide the {local} ranks of each "
                f"stage-3 shard group on one node; choose a divisor of {local}"
            )
