"""A pure single-device GPT: pre-LN transformer decoder, readable in one sitting.

Owns the model's math and its parameter names. Must not import torch.distributed, `parallel` or
`megazero`: tensor parallelism swaps modules from outside (parallel.parallelize), pipeline parallelism
deletes the modules a stage does not own (the forward below skips missing pieces), and ZeRO only sees
parameters. To keep those swaps possible, the forward infers local head counts from tensor shapes
rather than from the config, and layers live in a ModuleDict keyed by their global index so that a
parameter's name is the same in every layout.

Shapes are batch-first: tokens (b, s), hidden states (b, s, h). Packed samples
(models/documents.py) come in as one more input, `documents`, handed to the embedding (positions)
and to every layer's attention (positions, and attention kept inside each document).
"""

from __future__ import annotations

import functools
import hashlib
import math

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from einops import rearrange
from torch import nn

from .attention import RotaryTables, core_attention, rotate
from .config import GPTConfig
from .loss import linear_cross_entropy
from .moe import MoELayer
from .weight_grad import Embedding as Table, LayerNorm, Linear, RMSNorm, linear


class ZeroCenteredLayerNorm(LayerNorm):
    """LayerNorm scaling by weight + 1, weight initialised at 0 (Megatron's --apply-layernorm-1p):
    weight decay then pulls the scale towards 1 rather than 0."""

    zero_centered_gamma = True


class ZeroCenteredRMSNorm(RMSNorm):
    """RMSNorm scaling by weight + 1 (Transformer Engine's zero_centered_gamma, as Megatron uses it)."""

    zero_centered_gamma = True


def make_norm(config: GPTConfig) -> nn.Module:
    rms = config.normalization == "rmsnorm"
    if config.apply_layernorm_1p:
        kind = ZeroCenteredRMSNorm if rms else ZeroCenteredLayerNorm
    else:
        kind = RMSNorm if rms else LayerNorm
    return kind(config.hidden_size, eps=config.norm_epsilon)


class CoreAttention(nn.Module):
    """Causal attention over already-projected q (b,s,nq,d), k/v (b,s,ng,d): models.attention's
    core_attention with this layer's dropout and backend (and `documents`' boundaries)."""

    def __init__(self, dropout: float, backend: str = "auto"):
        super().__init__()
        self.dropout, self.backend = dropout, backend

    def forward(self, q, k, v, documents=None):
        return core_attention(q, k, v, self.dropout if self.training else 0.0, self.backend, documents)


class Attention(nn.Module):
    """Multi-head / grouped-query self-attention with a fused QKV projection.

    The QKV output is laid out group by group, [q heads of group g, k_g, v_g] for each of the
    query groups, so any contiguous slice of whole groups is itself a valid, smaller attention.
    Heads are `config.head_dim` wide (Megatron's --kv-channels), which need not be hidden / heads.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.head_dim = config.head_dim
        self.q_per_group = config.num_attention_heads // config.num_query_groups
        qkv_size = config.num_query_groups * (self.q_per_group + 2) * self.head_dim
        self.qkv = Linear(config.hidden_size, qkv_size, bias=config.add_bias_linear or config.add_qkv_bias)
        self.core = CoreAttention(config.attention_dropout, config.attention_backend)
        self.proj = Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=config.add_bias_linear)
        # checkpoint(function, *args) for selective recomputation of the core; set by GPT.set_checkpoint_fn
        self.recompute_core = None
        # positions(length, device) -> the positions of this layer's tokens when the sequence is split
        # outside the model (context parallelism sets it); None: 0 .. length-1
        self.positions = None

    def forward(self, x, rotary=None, documents=None):
        qkv = self.qkv(x)
        # groups are inferred from the width, so a tensor-parallel slice of whole groups works too
        qkv = rearrange(qkv, "b s (g r d) -> b s g r d", r=self.q_per_group + 2, d=self.head_dim)
        # Splits, not indexing: the backward of a split is one concatenation, where each slice or
        # select of qkv would cost a zero-filled qkv-sized gradient and an add.
        qk, v = qkv.split([self.q_per_group + 1, 1], dim=3)  # each group's q heads and k head; v
        if rotary is not None:  # q and k rotate together, in one expression
            # qkv's length: under sequence parallelism x holds a shard, qkv the whole local sequence
            positions = self.positions(qkv.shape[1], x.device) if self.positions is not None else None
            if documents is not None and documents.positions is not None:  # positions restart per document
                qk = rotate(qk, *documents.rotary_tables(*rotary, positions))
            else:
                qk = rotate(qk, *rotary, positions=positions)
        q, k = qk.split([self.q_per_group, 1], dim=3)
        q = rearrange(q, "b s g r d -> b s (g r) d")
        k, v = k.squeeze(3), v.squeeze(3)
        if self.recompute_core is not None and self.training:
            out = self.recompute_core(self.core, q, k, v, documents)
        else:
            out = self.core(q, k, v, documents)
        return self.proj(out)


class MLP(nn.Module):
    """Feed-forward block; with SwiGLU, fc1 emits [gate; up] halves (Shazeer, GLU variants)."""

    def __init__(self, config: GPTConfig, ffn_hidden_size: int | None = None):
        super().__init__()
        self.swiglu = config.activation == "swiglu"
        self.gelu_approximate = config.gelu_approximate
        ffn = ffn_hidden_size or config.ffn_hidden_size
        fc1_out = ffn * (2 if self.swiglu else 1)
        self.fc1 = Linear(config.hidden_size, fc1_out, bias=config.add_bias_linear)
        self.fc2 = Linear(ffn, config.hidden_size, bias=config.add_bias_linear)

    def forward(self, x):
        y = self.fc1(x)
        if self.swiglu:
            gate, up = y.chunk(2, dim=-1)
            y = F.silu(gate) * up
        else:
            y = F.gelu(y, approximate=self.gelu_approximate)
        return self.fc2(y)


class SharedExpertMLP(MLP):
    """A MoE layer's shared expert with a gate (Megatron-LM's --moe-shared-expert-gate, Qwen2-MoE's
    shared_expert_gate): the MLP's output times sigmoid(x . gate_weight), one scalar per token.
    Tensor parallelism splits fc1/fc2 as any MLP's; gate_weight (1, h) stays whole on every rank."""

    def __init__(self, config: GPTConfig, ffn_hidden_size: int):
        super().__init__(config, ffn_hidden_size)
        self.gate_weight = nn.Parameter(torch.empty(1, config.hidden_size))

    def forward(self, x):
        return super().forward(x) * torch.sigmoid(linear(x, self.gate_weight))


def shared_expert(config: GPTConfig) -> MLP | None:
    """The shared expert of a MoE layer (None without --moe-shared-expert-intermediate-size)."""
    width = config.moe_shared_expert_intermediate_size
    if not width:
        return None
    return SharedExpertMLP(config, width) if config.moe_shared_expert_gate else MLP(config, ffn_hidden_size=width)


class TransformerLayer(nn.Module):
    """Pre-LN attention then feed-forward: a dense MLP, or a mixture of experts (models/moe.py) where
    the config's --moe-layer-freq says so for layer `index`."""

    def __init__(self, config: GPTConfig, index: int = 0):
        super().__init__()
        self.input_norm = make_norm(config)
        self.attention = Attention(config)
        self.attention_dropout = nn.Dropout(config.hidden_dropout)
        self.mlp_norm = make_norm(config)
        if config.is_moe_layer(index):
            self.mlp = MoELayer(config, shared_expert(config))
        else:
            self.mlp = MLP(config)
        self.mlp_dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, x, rotary=None, documents=None):
        x = x + self.attention_dropout(self.attention(self.input_norm(x), rotary, documents))
        return x + self.mlp_dropout(self.mlp(self.mlp_norm(x)))


class Embedding(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.word = Table(config.padded_vocab_size, config.hidden_size)
        self.position = (
            Table(config.max_position_embeddings, config.hidden_size)
            if config.position_embedding == "learned"
            else None
        )
        self.dropout = nn.Dropout(config.hidden_dropout)
        self.positions = None  # as Attention.positions

    def forward(self, tokens, documents=None):
        x = self.word(tokens)
        if self.position is not None:
            x = x + self.position(token_positions(self.positions, tokens, documents))
        return self.dropout(x)


def token_positions(positions, tokens: torch.Tensor, documents=None) -> torch.Tensor:
    """The positions of `tokens` (b, s) in their sequences: `positions(s, device)` when the sequence
    is split outside the model, else 0 .. s-1; (b, s) positions in their documents when `documents`
    restart them."""
    index = positions(tokens.shape[1], tokens.device) if positions is not None else None
    if documents is not None and documents.positions is not None:
        return documents.token_positions(index)
    return index if index is not None else torch.arange(tokens.shape[1], device=tokens.device)


class LMHead(nn.Module):
    """Output projection to the (padded) vocabulary, and the per-token loss over the real vocabulary
    (models.loss: the projection and the cross entropy fused, chunk by chunk, so the full logits
    never exist when there are labels).

    Padding rows exist so the vocabulary splits evenly under tensor parallelism; they are cut off
    here (and masked in the parallel version) so padding never changes the loss.
    """

    def __init__(self, config: GPTConfig, weight: nn.Parameter | None = None):
        super().__init__()
        self.vocab_size = config.vocab_size
        self.weight = (
            weight if weight is not None else nn.Parameter(torch.empty(config.padded_vocab_size, config.hidden_size))
        )

    def forward(self, x, labels=None):
        if labels is None:
            return F.linear(x, self.weight)[..., : self.vocab_size]
        return linear_cross_entropy(x, self.weight, labels, self.vocab_size)


class GPT(nn.Module):
    """forward(tokens | hidden, labels=None, documents=None) -> per-token losses (b, s) | logits |
    hidden states.

    A pipeline stage without the embedding takes hidden states; one without the head returns them.
    `documents` (models.documents.Documents): the packed microbatch's documents, whole; positions
    restart and attention stays inside each document as it says.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.embedding = Embedding(config)
        self.layers = nn.ModuleDict({str(i): TransformerLayer(config, i) for i in range(config.num_layers)})
        self.final_norm = make_norm(config)
        tied = self.embedding.word.weight if config.tie_embeddings else None
        self.output_head = LMHead(config, weight=tied)
        # Tables built once per (length, device, dtype) and handed to every layer.
        self.rotary = (
            RotaryTables(config.head_dim, config.rotary_dim, config.rotary_base)
            if config.position_embedding == "rope"
            else None
        )
        self.set_checkpoint_fn(functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False))

    def set_checkpoint_fn(self, checkpoint_fn) -> None:
        """The activation checkpoint function recomputation runs through (parallel.parallelize
        installs one that also replays the tensor-parallel RNG streams)."""
        self.checkpoint_fn = checkpoint_fn
        selective = self.config.recompute_granularity == "selective"
        for layer in self.layers.values():
            layer.attention.recompute_core = checkpoint_fn if selective else None

    def forward(self, inputs, labels=None, documents=None):
        if documents is not None:  # what its layers derive from it lives as long as this forward's graph
            documents = documents.fresh()
        x = self.embedding(inputs, documents) if self.embedding is not None else inputs
        rotary = None
        if self.rotary is not None:  # every position of a sequence, even if inputs hold a part of it
            length = max(self.config.max_position_embeddings, self.config.seq_length, inputs.shape[1])
            rotary = self.rotary.get(length, x.device, x.dtype)
        x = self._run_layers(x, rotary, documents)
        if self.final_norm is not None:
            x = self.final_norm(x)
        if self.output_head is None:
            return x
        return self.output_head(x, labels)

    def _run_layers(self, x, rotary, documents=None):
        """This chunk's layers, with full recomputation as Megatron-LM counts it: per model chunk
        (pipeline stage), "uniform" checkpoints groups of recompute_num_layers consecutive layers,
        "block" the first recompute_num_layers layers one by one."""
        layers = list(self.layers.values())
        cfg = self.config
        if cfg.recompute_granularity != "full" or not self.training:
            for layer in layers:
                x = layer(x, rotary, documents)
            return x
        n = cfg.recompute_num_layers
        if cfg.recompute_method == "uniform":
            for lo in range(0, len(layers), n):
                x = self.checkpoint_fn(
                    _Recomputed(_Sequence(layers[lo : lo + n]), layers[lo : lo + n]), x, rotary, documents
                )
            return x
        for i, layer in enumerate(layers):
            x = (
                self.checkpoint_fn(_Recomputed(layer, [layer]), x, rotary, documents)
                if i < n
                else layer(x, rotary, documents)
            )
        return x


class _Recomputed:
    """A checkpointed function whose later calls are the backward's recomputation: the MoE layers in
    it do not gather their routing statistics (loads, losses) a second time then."""

    def __init__(self, function, layers):
        self.function, self.calls, self.layers = function, 0, layers
        self.moe = [layer.mlp for layer in layers if isinstance(layer.mlp, MoELayer)]

    def __call__(self, *args):
        self.calls += 1
        if self.calls == 1 or not self.moe:
            return self.function(*args)
        kept = [moe.stats for moe in self.moe]
        for moe in self.moe:
            moe.stats = None
        try:
            return self.function(*args)
        finally:
            for moe, stats in zip(self.moe, kept):
                moe.stats = stats


class _Sequence:
    """Layers run one after another, as one function for a checkpoint (not a module: the layers
    keep their names and hooks where they are)."""

    def __init__(self, layers):
        self.layers = layers

    def __call__(self, x, rotary, documents=None):
        for layer in self.layers:
            x = layer(x, rotary, documents)
        return x


# --- layout-independent initialisation ----------------------------------------------------------


def init_std(config: GPTConfig, name: str) -> float | None:
    """Std of a weight's normal init, None for ones (norm scales), 0 for zeros (biases, and the
    norm scales of a zero-centred norm, which multiplies by weight + 1).

    Output projections of residual branches are scaled by 1/sqrt(2L) (GPT-2's residual scaling).
    """
    if name.endswith(".bias"):
        return 0.0
    if "norm" in name.rsplit(".", 2)[-2]:
        return 0.0 if config.apply_layernorm_1p else None
    if name.endswith(("attention.proj.weight", "mlp.fc2.weight", "shared_experts.fc2.weight", "experts.weight2")):
        return config.init_method_std / math.sqrt(2.0 * config.num_layers)
    return config.init_method_std


def initial_value(config: GPTConfig, name: str, full_shape, seed: int) -> torch.Tensor:
    """The full fp32 value of parameter `name`; depends only on (seed, name) and the real shapes.

    Vocabulary rows beyond the real vocabulary (padding) are zero, so the value of every real row is
    the same whatever the padding (and hence the tensor-parallel degree).
    """
    std = init_std(config, name)
    if std is None:
        return torch.ones(full_shape)
    if std == 0.0:
        return torch.zeros(full_shape)
    shape = list(full_shape)
    vocab_rows = name in ("embedding.word.weight", "output_head.weight")
    if vocab_rows:
        shape[0] = config.vocab_size
    generator = torch.Generator().manual_seed(_name_seed(seed, name))
    value = torch.empty(shape).normal_(0.0, std, generator=generator)
    if vocab_rows and full_shape[0] > shape[0]:
        value = torch.cat([value, value.new_zeros(full_shape[0] - shape[0], *shape[1:])])
    return value


def _name_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
