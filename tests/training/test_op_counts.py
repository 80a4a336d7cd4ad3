"""What one training step costs in operations, counted: a step that grows (more GEMMs, more
elementwise passes, an extra copy, a host sync) fails here, whatever the machine's load.

One forward + backward + optimizer step of `megazero.training.train_step` runs under a
TorchDispatchMode that sorts every aten op into kernels of a kind (matmuls, attention, elementwise,
reductions, copies and fills, other) and host syncs (an op whose result the host must read: .item(),
nonzero, ...); views, which launch nothing, are not counted. On a GPU each counted op is a kernel
launch (the fused C++ CPU Adam runs outside the dispatcher and counts nothing here; torch's fused
AdamW on a GPU would be one op per parameter group). Counts are exact and deterministic: budgets
are per layer plus a fixed part, each counted at 2 and 3 layers, so a per-layer cost cannot hide in
the fixed part.

The budgets are today's counts of torch 2.13's CPU ops: a new op in the step must raise one, in the
same commit, with a reason. The last test plants the output layer's old chunking (vocab / hidden
chunks, logits recomputed in backward) and checks that the budgets catch it.
"""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megazero.config.train_config import OptimizerConfig, TrainConfig
from megazero.data.synthetic import SyntheticTokens
from megazero.models.config import GPTConfig
from megazero.ops.adam_config import AdamConfig
from megazero.parallel.process_groups import ProcessGroups
from megazero.parallel.topology import Topology
from megazero.data.sampler import MicrobatchSource
from megazero.training import setup, train_step
from megazero.zero.config import ZeroConfig

MATMULS = {"mm", "addmm", "bmm", "baddbmm", "mv", "addmv", "dot", "matmul", "_scaled_mm"}
ATTENTION = ("_scaled_dot_product", "_flash_attention", "_efficient_attention", "_cudnn_attention")
REDUCTIONS = {
    "_foreach_norm",
    "native_layer_norm",
    "native_layer_norm_backward",
    "_fused_rms_norm",
    "_fused_rms_norm_backward",
    "_log_softmax",
    "_log_softmax_backward_data",
    "_softmax",
    "_softmax_backward_data",
    "nll_loss_forward",
    "nll_loss_backward",
}
COPIES = {
    "clone",
    "copy_",
    "_to_copy",
    "cat",
    "stack",
    "slice_backward",
    "select_backward",
    "gather",
    "scatter",
    "scatter_",
    "scatter_add",
    "scatter_add_",
    "index_select",
    "index_add_",
    "index_copy_",
    "embedding",
    "embedding_dense_backward",
    "flip",
    "repeat",
    "repeat_interleave",
    "zeros",
    "zeros_like",
    "ones",
    "ones_like",
    "full",
    "full_like",
    "new_zeros",
    "new_full",
    "fill_",
    "zero_",
    "arange",
    "_foreach_copy_",
}
NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "_unsafe_view", "lift_fresh"}
HOST_SYNCS = {"is_nonzero", "equal", "item"}  # besides ops tagged data_dependent_output
KINDS = ("matmuls", "attention", "elementwise", "reductions", "copies", "other", "collectives", "host_syncs")


def kind_of(func) -> str | None:
    """The kind of kernel an aten op launches, None for views and bare allocations."""
    name = func.overloadpacket.__name__
    if func.namespace == "c10d":
        return "collectives"
    if torch.Tag.data_dependent_output in func.tags or name in HOST_SYNCS:
        return "host_syncs"
    returns = func._schema.returns
    if name in NO_KERNEL or (returns and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)):
        return None
    if name in MATMULS:
        return "matmuls"
    if name.startswith(ATTENTION):
        return "attention"
    if name in COPIES:
        return "copies"
    if name in REDUCTIONS or torch.Tag.reduction in func.tags:
        return "reductions"
    if torch.Tag.pointwise in func.tags:
        return "elementwise"
    return "other"


class OpCounter(TorchDispatchMode):
    """Counts the ops run under it by kind, and by name (for the failure message)."""

    def __init__(self):
        super().__init__()
        self.kinds, self.names = collections.Counter(), collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = kind_of(func)
        if kind is not None:
            self.kinds[kind] += 1
            self.names[f"{kind}: {func}"] += 1
        return func(*args, **(kwargs or {}))


SHAPE = dict(
    vocab_size=2048, hidden_size=64, num_attention_heads=4, seq_length=32, hidden_dropout=0.0, attention_dropout=0.0
)
# Micro batch 2 x seq 32 = 64 tokens: the old chunking cut vocab 2048 / hidden 64 = 32 chunks.
LLAMA = dict(
    position_embedding="rope",
    activation="swiglu",
    normalization="rmsnorm",
    tie_embeddings=False,
    num_query_groups=2,
    add_bias_linear=False,
)
MODELS = {"gpt2": {}, "llama": LLAMA}


def step_counts(layers: int, options: dict, zero: ZeroConfig = ZeroConfig(), groups=None, dp: int = 1) -> dict:
    """Counts of the third step (the first two record stage 3's trace and warm every cache)."""
    cfg = GPTConfig(num_layers=layers, **SHAPE, **options)
    adam = AdamConfig(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    train = TrainConfig(
        model=cfg,
        zero=zero,
        optimizer=OptimizerConfig(lr=1e-3, adam=adam, clip_grad=1.0),
        seed=1,
        micro_batch_size=2,
        global_batch_size=2 * dp,
    )
    state = setup(train, groups if groups is not None else ProcessGroups.single())
    rank = groups.coords.dp if groups is not None else 0
    source = MicrobatchSource(SyntheticTokens(cfg.vocab_size, cfg.seq_length, seed=1), 2 * dp, 2, rank, dp)
    for i in range(2):
        train_step(state, source.batch(i), 1e-3)
    with OpCounter() as counter:
        train_step(state, source.batch(2), 1e-3)
    return {"kinds": dict(counter.kinds), "names": dict(counter.names)}


@dataclasses.dataclass(frozen=True)
class Budget:
    per_layer: int
    fixed: int


def over_budget(counts: dict[int, dict], budgets: dict[str, Budget]) -> list[str]:
    """Every kind whose count at some layer count exceeds per_layer x layers + fixed, and every
    kind counted that has no budget."""
    problems = []
    for layers, counted in counts.items():
        kinds = counted["kinds"]
        for kind in sorted(set(kinds) | set(budgets)):
            budget = budgets.get(kind, Budget(0, 0))
            allowed = budget.per_layer * layers + budget.fixed
            if kinds.get(kind, 0) > allowed:
                ops = {n: c for n, c in counted["names"].items() if n.startswith(kind + ":")}
                problems.append(
                    f"{layers} layers: {kinds.get(kind, 0)} {kind} > budget {allowed} "
                    f"({budget.per_layer} x {layers} + {budget.fixed}); {ops}"
                )
    return problems


# One process, ZeRO stage 0, fp32, one microbatch, clipping on, the fused C++ Adam (not counted).
BUDGETS = {
    "gpt2": {
        # 4 linears a layer (qkv, proj, fc1, fc2) x (forward, input grad, weight grad) = 12; the
        # head's logits, input grad and weight grad = 3 (the old chunking: 4 per chunk, 128 here).
        "matmuls": Budget(12, 3),
        # SDPA's forward and backward, per layer.
        "attention": Budget(2, 0),
        # per layer: GELU and its backward, the 2 residual adds and their 2 gradient sums, and 12
        # parameters' gradients added into stage 0's flat buffer; fixed: the embedding's position
        # add and its 2 tables' gradients added, the loss (label masks, max shift, exp, log; in
        # backward one pass over the kept exp and per-token scales), the global loss, clipping.
        "elementwise": Budget(18, 31),
        # per layer: 2 LayerNorms forward and backward, 4 bias gradients; fixed: the final norm
        # forward and backward, the loss's max and sums, the summed loss, clipping's norms.
        "reductions": Budget(8, 13),
        # per layer: the two QKV splits' backward (a concatenation each); fixed: the embedding
        # lookups and their backward, the loss's statistics and labels, the batch and lr copies.
        "copies": Budget(2, 26),
        "host_syncs": Budget(0, 1),  # the step's loss, read once
    },
    "llama": {
        "matmuls": Budget(12, 3),  # as GPT-2's (fc1 emits gate and up in one GEMM)
        "attention": Budget(2, 0),
        # per layer: 2 RMSNorms (torch's CPU rms_norm is composite: pow, add, rsqrt, muls, and ~20
        # ops of backward), RoPE's products and sum forward and backward, SwiGLU and its backward,
        # 2 residual adds and their gradient sums, 6 gradients into the flat buffer; fixed: the
        # final RMSNorm, the loss, the global loss, clipping.
        "elementwise": Budget(55, 45),
        "reductions": Budget(6, 13),  # per layer: the RMSNorms' means and weight gradients
        # per layer: the QKV splits' and the gate/up split's backward, RoPE's pair swap (a flip)
        # forward and backward, q's heads made contiguous; fixed: as GPT-2's, one table fewer.
        "copies": Budget(6, 23),
        "host_syncs": Budget(0, 1),
    },
}


@pytest.mark.parametrize("model", list(MODELS))
def test_one_process_step_stays_within_its_op_budget(model):
    counts = {layers: step_counts(layers, MODELS[model]) for layers in (2, 3)}
    assert counts[2] == step_counts(2, MODELS[model]), "the counts are deterministic"
    problems = over_budget(counts, BUDGETS[model])
    assert not problems, "\n".join(problems)


def _zero3_counts(ctx, layers):
    groups = ctx.groups(Topology(world_size=2))
    # persistence 0: every module's parameters are gathered (this model's would all stay whole)
    return step_counts(layers, {}, ZeroConfig(stage=3, param_persistence_threshold=0), groups, dp=2)


# Two gloo ranks, ZeRO stage 3 (persistence 0), GPT-2 shape: the one-process model's kernels, less
# stage 0's gradient adds, plus the units' gathers and reduce-scatters and their copies.
ZERO3_BUDGETS = {
    **BUDGETS["gpt2"],
    "elementwise": Budget(6, 23),  # GELU, residual adds and their sums; no flat-buffer adds
    "reductions": Budget(8, 10),
    # per layer: each of the 6 units' gathered weights copied out of the gather buffer and its
    # gradients copied into the reduce-scatter's, the QKV splits' backward; fixed: the same for the
    # embedding and the final norm, the loss, the batch.
    "copies": Budget(26, 33),
    # per layer: 6 units (2 norms, qkv, proj, fc1, fc2), one all-gather and one reduce-scatter each
    # (the gathered weights are reused in backward: max_reuse_distance); fixed: the embedding's
    # and the final norm's units, the global loss's and the gradient norm's all-reduces.
    "collectives": Budget(12, 8),
    "host_syncs": Budget(0, 1),
}


def test_zero3_step_on_two_ranks_stays_within_its_op_budget(dist_pool):
    pool = dist_pool(2)
    counts = {layers: pool.run(_zero3_counts, layers) for layers in (2, 3)}
    for layers, ranks in counts.items():
        for rank in ranks:
            problems = over_budget({layers: rank}, ZERO3_BUDGETS)
            assert not problems, "\n".join(problems)


def _old_chunk_tokens(tokens: int, vocab_rows: int, hidden: int) -> int:
    """The rule before the memory budget: vocab / hidden chunks, whatever the token count."""
    chunks = max(1, -(-vocab_rows // max(1, hidden)))
    return max(1, -(-tokens // chunks))


def test_the_budgets_catch_the_old_chunking(monkeypatch):
    from megazero.models import loss

    planted = lambda tokens, vocab_rows: _old_chunk_tokens(tokens, vocab_rows, SHAPE["hidden_size"])
    monkeypatch.setattr(loss, "chunk_tokens_for", planted)
    problems = over_budget({2: step_counts(2, {})}, BUDGETS["gpt2"])
    assert any("matmuls" in p for p in problems), problems
    assert any("elementwise" in p for p in problems), problems
