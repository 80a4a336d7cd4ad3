"""Reading megatron-core's distributed-optimizer state (Adam's fp32 master weights, exp_avg and
exp_avg_sq) and its training progress out of a Megatron-LM checkpoint, as full tensors by
megatron-core parameter name; megatron_files.py calls it. Must not know megazero's names.

Where megatron-core keeps the states:
- torch_dist, sharding type `fully_reshardable` (Megatron-LM's --dist-ckpt-optim-fully-reshardable):
  one tensor per parameter and state, `optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>`, of
  the model key's global shape (layers stacked like the model's). `dp_reshardable` (Megatron-LM's
  default) keeps the optimizer's flat buckets instead, `optimizer.distributed.dp_group_idx_<d>.
  gbuf_idx_<g>.dtype_<..>.bucket_idx_<b>.<state>` per model-parallel domain d (pipeline rank x TP +
  tensor rank) and grad buffer g (a virtual-pipeline chunk), each bucket without its end padding:
  joined, the legacy buffer below. A mixture of experts chains two optimizers, `chained_0.` (dense)
  and `chained_1.` (experts: domains per pipeline, expert and tensor rank).
  The file does not record the parameter order: megatron-core's registration order is tried for the
  local and the Transformer Engine layer specs, and kept where every master is its weight.
- legacy (`--ckpt-format torch`): `distrib_optim.pt` beside each `model_optim_rng.pt`, holding per
  grad buffer and dtype the flat fp32 `param`, `exp_avg`, `exp_avg_sq` of the whole data-parallel
  group, buckets concatenated without their end padding. Positions follow megatron-core's buffer
  layout (distributed/param_and_grad_buffer.py): the parameters in reverse registration order, each
  starting at a multiple of 64 elements from its bucket's start; a bucket closes once it holds
  `bucket_size` elements (only with --overlap-grad-reduce, and on the first pipeline stage), and a
  tied embedding shared across pipeline stages takes a bucket of its own. The layout is rebuilt
  from the model file's parameter order and checked against the buffer's recorded length.

Progress: the iteration, Adam's step (the optimizer's param_groups), the lr scheduler's state
(`opt_param_scheduler`: num_steps, warmup and decay in samples, peak and final lr, weight decay) and
the consumed samples (`args.consumed_train_samples`).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import NamedTuple

import torch

STATES = ("param", "exp_avg", "exp_avg_sq")
OPTIM_FILE = "distrib_optim.pt"
# a chained optimizer's (the dense parameters' and the experts') names begin chained_<index>.
_OPTIMIZER = re.compile(r"^(chained_\d+\.)?optimizer\.")
_FULL = re.compile(r"^(?:chained_\d+\.)?optimizer\.state\.(param|exp_avg|exp_avg_sq)\.(.+)$")


class MegatronOptimizerError(ValueError):
    """Optimizer state megazero cannot read exactly; the message names what and the way out."""


def _parts(optimizer: dict | list | None) -> list:
    """A megatron-core optimizer state dict's parts: a chained optimizer's (the dense parameters' and
    the experts') is a list, or in torch_dist's common.pt a dict by index."""
    if isinstance(optimizer, dict) and optimizer and all(isinstance(key, int) for key in optimizer):
        return [optimizer[key] for key in sorted(optimizer)]
    return optimizer if isinstance(optimizer, list) else [optimizer]


def adam_step(optimizer: dict | list | None) -> int | None:
    """Adam's step count from a megatron-core optimizer state dict; None when it holds none (a
    checkpoint saved without its optimizer)."""
    parts = _parts(optimizer)
    steps = set()
    for part in parts:
        inner = (part or {}).get("optimizer", part) or {}
        steps |= {int(g["step"]) for g in inner.get("param_groups", []) if g.get("step") is not None}
    if len(steps) > 1:
        raise MegatronOptimizerError(f"the optimizer's parameter groups are at different steps {sorted(steps)}")
    return steps.pop() if steps else None


def adam_hyper(optimizer: dict | list | None) -> dict:
    """betas and eps of the first parameter group ({} when there is none)."""
    part = _parts(optimizer)[0] if optimizer else optimizer
    groups = ((part or {}).get("optimizer", part) or {}).get("param_groups", [])
    if not groups:
        return {}
    beta1, beta2 = groups[0].get("betas", (0.9, 0.999))
    return {"beta1": float(beta1), "beta2": float(beta2), "eps": float(groups[0].get("eps", 1e-8))}


_BUCKET = re.compile(
    r"^(?:chained_(\d+)\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.+)\.bucket_idx_(\d+)\."
    r"(param|exp_avg|exp_avg_sq)$"
)


def is_optimizer(name: str) -> bool:
    """Whether a torch_dist checkpoint's tensor `name` is the optimizer's (else the model's)."""
    return _OPTIMIZER.match(name) is not None


def split_torch_dist(stacked: dict, where: Path) -> tuple[dict, dict, dict]:
    """(model tensors, {state: {model key: tensor}} of the fully_reshardable format, {optimizer (0:
    the dense parameters', 1: a mixture's experts'): {model-parallel domain: {grad buffer (a
    virtual-pipeline chunk): [{state: tensor} per bucket]}}} of the dp_reshardable one) from a
    torch_dist checkpoint's tensors."""
    model, states, buckets, dtypes = {}, {state: {} for state in STATES}, {}, set()
    for name, tensor in stacked.items():
        full, bucket = _FULL.match(name), _BUCKET.match(name)
        if full:
            states[full.group(1)][full.group(2)] = tensor
        elif bucket:
            chain, domain, buffer, dtype, index, state = bucket.groups()
            dtypes.add(dtype)
            per = buckets.setdefault(int(chain or 0), {}).setdefault(int(domain), {}).setdefault(int(buffer), {})
            per.setdefault(int(index), {})[state] = tensor
        elif not is_optimizer(name):
            model[name] = tensor
    if len(dtypes) > 1:
        raise MegatronOptimizerError(
            f"{where}: the optimizer's grad buffers have {len(dtypes)} dtypes; megazero reads "
            f"one parameter dtype; pass --weights-only to import the weights alone"
        )
    return (
        model,
        states if states["param"] else {},
        {
            chain: {
                domain: {buffer: [per[i] for i in sorted(per)] for buffer, per in sorted(buffers.items())}
                for domain, buffers in domains.items()
            }
            for chain, domains in buckets.items()
        },
    )


# The order megatron-core's TransformerLayer registers its parameters in (its grad buffer's order,
# reversed), by torch_dist name, for the local spec and the Transformer Engine one (the norms fused
# into the next linear); a dp_reshardable import tries each, keeping the one the masters confirm.
_LINEARS = ("self_attention.linear_proj.weight", "self_attention.linear_proj.bias")
_QKV = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias")
_NORM1 = ("self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.layer_norm_bias")
_NORM2 = ("mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.layer_norm_bias")
# a mixture of experts' layer registers its router there; its experts sit in the experts' optimizer
_MLP = (
    "mlp.router.weight",
    "mlp.linear_fc1.weight",
    "mlp.linear_fc1.bias",
    "mlp.linear_fc2.weight",
    "mlp.linear_fc2.bias",
)
LAYER_ORDERS = {
    "local": _NORM1 + _LINEARS + _QKV + _NORM2 + _MLP,
    "transformer_engine": _LINEARS + _NORM1 + _QKV + _NORM2 + _MLP,
}


def registration_order(names, spec: str) -> list[str] | None:
    """The model's parameter names in megatron-core's registration order under `spec` (None when a
    name falls outside what that order knows)."""
    names = set(names)
    order = [n for n in ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight") if n in names]
    layers = sorted({int(m.group(1)) for m in map(re.compile(r"^decoder\.layers\.(\d+)\.").match, names) if m})
    for i in layers:
        order += [f"decoder.layers.{i}.{rest}" for rest in LAYER_ORDERS[spec] if f"decoder.layers.{i}.{rest}" in names]
    order += [
        n
        for n in ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "output_layer.weight")
        if n in names
    ]
    return order if set(order) == names else None


def _pad(n: int, divisor: int) -> int:
    return math.ceil(n / divisor) * divisor


def buffer_layout(params: list[tuple[str, int]], bucket_size: int | None, shared: set[str]) -> tuple[dict, int]:
    """Where each parameter's elements sit in a legacy distrib_optim.pt buffer (buckets joined without
    their end padding): ({name: (start, end)}, the buffer's length). `params`: (name, numel) in
    registration order; `shared`: the tied embedding that takes a bucket of its own."""
    where, base, at, end, filled = {}, 0, 0, 0, False
    for name, numel in reversed(params):
        at = _pad(at, 64)
        if name in shared and filled:  # the open bucket closes here, its padding included
            base, at, filled = base + at, 0, False
        where[name] = (base + at, base + at + numel)
        end, filled = at + numel, True
        if (bucket_size is not None and end >= bucket_size) or name in shared:
            base, at, filled = base + end, 0, False
        else:
            at = end
    return where, base + (end if filled else 0)


def _bucket_size(args: dict, pp_rank: int, chunk: int) -> int | None:
    if args.get("ddp_num_buckets"):
        raise MegatronOptimizerError(
            "the run set --ddp-num-buckets, whose bucket boundaries the checkpoint does "
            "not record; pass --weights-only to import the weights alone"
        )
    # megatron-core buckets the first chunk of the first stage alone (the others reduce in one go)
    if not args.get("overlap_grad_reduce") or pp_rank > 0 or chunk > 0:
        return None
    if args.get("ddp_bucket_size"):
        return int(args["ddp_bucket_size"])
    model_parallel = (args.get("tensor_model_parallel_size") or 1) * (args.get("pipeline_model_parallel_size") or 1)
    dp = args.get("data_parallel_size") or args.get("world_size", model_parallel) // model_parallel
    return max(40_000_000, 1_000_000 * dp)


class Chunk(NamedTuple):
    """One grad buffer's place: the model chunk's pipeline stage and virtual chunk, and the tied
    embedding's copy it keeps in a bucket of its own (megatron_stages.shared_embedding)."""

    pp_rank: int = 0
    vp_stage: int = 0
    shared: frozenset = frozenset()


def bucket_rank_states(buckets: list[dict], model: dict, args: dict, where: Path, chunk: Chunk = Chunk()) -> dict:
    """{state: {name: shard}} of one model-parallel domain's dp_reshardable buckets of one grad
    buffer (joined they are the legacy buffer), laid out over `model` (the chunk's shards in
    registration order)."""
    world = {state: torch.cat([bucket[state] for bucket in buckets]) for state in STATES}
    return _place(world, model, args, chunk, where, len(world["param"]))


def legacy_buffers(file: Path, loaded: dict | list) -> list[list[dict] | None]:
    """The flat fp32 buffers of one distrib_optim.pt per optimizer (one, or with experts the dense
    optimizer's then the experts'; None where the file keeps none), each a list per grad buffer
    (virtual-pipeline chunk)."""
    out = []
    for part in loaded if isinstance(loaded, list) else [loaded]:
        if part is None:
            out.append(None)
            continue
        buffers = []
        for key in sorted(k for k in part if isinstance(k, int)):
            if len(part[key]) != 1:
                raise MegatronOptimizerError(
                    f"{file}: grad buffer {key} holds {len(part[key])} dtypes; megazero "
                    f"reads one parameter dtype; pass --weights-only to import the weights alone"
                )
            buffers.append(next(iter(part[key].values())))
        out.append(buffers)
    return out


def legacy_rank_states(file: Path, world: dict, model: dict, args: dict, chunk: Chunk) -> dict:
    """{state: {name: this rank's (tensor-parallel shard) tensor}} from one grad buffer of a
    distrib_optim.pt, laid out over `model` (the chunk's model_optim_rng.pt tensors, in their order)."""
    return _place(world, model, args, chunk, file, world["numel_unpadded"])


def _place(world: dict, model: dict, args: dict, chunk: Chunk, where: Path, length_saved: int) -> dict:
    """{state: {name: tensor shaped as the model's}} out of flat buffers `world` laid out over `model`
    (a chunk's tensors in registration order), refused when the layout's length is not the saved one."""
    params = [(name, t.numel()) for name, t in model.items() if not name.endswith("_extra_state")]
    layout, length = buffer_layout(params, _bucket_size(args, chunk.pp_rank, chunk.vp_stage), set(chunk.shared))
    if length != length_saved:
        raise MegatronOptimizerError(
            f"{where}: its buffer holds {length_saved} elements, megatron-core's "
            f"layout of the model file gives {length}; pass --weights-only to import the "
            f"weights alone"
        )
    return {
        state: {name: world[state][start:end].view_as(model[name]).clone() for name, (start, end) in layout.items()}
        for state in STATES
    }


def progress(common: dict, args: dict) -> dict:
    """The run's progress as a Megatron-LM checkpoint records it: iteration, Adam step (None without
    optimizer state), the lr scheduler's state, consumed samples, Adam's betas and eps."""
    return {
        "iteration": int(common.get("iteration", 0) or 0),
        "adam_step": adam_step(common.get("optimizer")),
        "scheduler": common.get("opt_param_scheduler"),
        "adam": adam_hyper(common.get("optimizer")),
        "consumed_samples": int(args.get("consumed_train_samples") or 0),
    }


# Why a checkpoint's masters can sit under the wrong names, by its optimizer layout, and the re-save
# that avoids it.
MASTERS_MISPLACED = {
    "fully_reshardable": "megatron-core 0.16's fully_reshardable save with several buckets per buffer writes them so; "
    "re-save with one bucket or in the legacy format",
    "dp_reshardable": "the buckets' order or padding is not megatron-core 0.16's; re-save in the legacy format",
    "legacy": "distrib_optim.pt's buffers are not in megatron-core 0.16's order; re-save with --ckpt-format torch_dist",
}


def check_masters(model: dict, states: dict, where: Path, layout: str = "fully_reshardable") -> None:
    """Every weight has its states, and its fp32 master rounds to the weight itself (megatron-core
    copies the masters into the model after each step): a misplaced state refuses the import, the
    message naming what misplaces them in the checkpoint's `layout` (MASTERS_MISPLACED)."""
    for name, weight in model.items():
        master = states["param"].get(name)
        if master is None or any(name not in states[kind] for kind in STATES):
            raise MegatronOptimizerError(
                f"{where}: the optimizer holds no state for {name}; pass --weights-only to import the weights alone"
            )
        if tuple(master.shape) != tuple(weight.shape) or not torch.equal(master.to(weight.dtype), weight):
            raise MegatronOptimizerError(
                f"{where}: the optimizer's fp32 master of {name} is not the model's weight (misplaced states: "
                f"{MASTERS_MISPLACED[layout]}); pass --weights-only to import the weights alone"
            )
        if tuple(master.shape) != tuple(weight.shape) or not torch.equal(master.to(weight.dtype), weight):
            raise MegatronOptimizerError(
                f"{where}: the optimizer's fp32 master of {name} is not the model's weight (misplaced states: "
                f"megatron-core 0.16's fully_reshardable save with several buckets per buffer writes them so); "
                f"re-save with one bucket or in the legacy format, or pass --weights-only to import the weights alone"
            )
