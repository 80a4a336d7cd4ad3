"""A pure single-device GPT: pre-LN transformer decoder, readable in one sitting.

Owns the model's math and its parameter names. Must not import torch.distributed, `parallel` or
`megazero`: tensor parallelism swaps modules from outside (parallel.parallelize), pipeline parallelism
deletes the modules a stage does not own (the forward below skips missing pieces), and ZeRO only sees
parameters. To keep those swaps possible, the forward infers local head counts from tensor shapes
rather than from the config, and layers live in a ModuleDict keyed by their global index so that a
parameter's name is the same in every layout.

Shapes are batch-first: tokens (b, s), hidden states (b, s, h).
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

from .config import GPTConfig


def rotary_cos_sin(seq_len: int, head_dim: int, base: float, device, dtype):
    """cos/sin tables (s, head_dim/2) for rotary position embeddings (Su et al., RoFormer)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates pairs (x[2i], x[2i+1]) of x (b, s, heads, d) by the position's angle."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.flatten(-2)


def make_norm(config: GPTConfig) -> nn.Module:
    if config.normalization == "rmsnorm":
        return nn.RMSNorm(config.hidden_size, eps=config.norm_epsilon)
    return nn.LayerNorm(config.hidden_size, eps=config.norm_epsilon)


class CoreAttention(nn.Module):
    """Causal scaled-dot-product attention over already-projected q (b,s,nq,d), k/v (b,s,ng,d)."""

    def __init__(self, dropout: float):
        super().__init__()
        self.dropout = dropout

    def forward(self, q, k, v):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))       # (b, heads, s, d)
        if k.shape[1] != q.shape[1]:                            # grouped-query attention
            repeat = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                             dropout_p=self.dropout if self.training else 0.0)
        return out.transpose(1, 2).flatten(2)                   # (b, s, nq*d)


class Attention(nn.Module):
    """Multi-head / grouped-query self-attention with a fused QKV projection.

    The QKV output is laid out group by group, [q heads of group g, k_g, v_g] for each of the
    query groups, so any contiguous slice of whole groups is itself a valid, smaller attention.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.rotary_base = config.rotary_base if config.position_embedding == "rope" else None
        self.q_per_group = config.num_attention_heads // config.num_query_groups
        qkv_size = config.num_query_groups * (self.q_per_group + 2) * self.head_dim
        self.qkv = nn.Linear(config.hidden_size, qkv_size, bias=config.add_bias_linear)
        self.core = CoreAttention(config.attention_dropout)
        self.proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size,
                              bias=config.add_bias_linear)

    def forward(self, x):
        qkv = self.qkv(x)
        s = qkv.shape[1]           # the full sequence even when x is a sequence-parallel shard
        # groups are inferred from the width, so a tensor-parallel slice of whole groups works too
        qkv = rearrange(qkv, "b s (g r d) -> b s g r d", r=self.q_per_group + 2, d=self.head_dim)
        q = rearrange(qkv[:, :, :, :self.q_per_group], "b s g r d -> b s (g r) d")
        k, v = qkv[:, :, :, -2], qkv[:, :, :, -1]
        if self.rotary_base is not None:
            cos, sin = rotary_cos_sin(s, self.head_dim, self.rotary_base, x.device, q.dtype)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return self.proj(self.core(q, k, v))


class MLP(nn.Module):
    """Feed-forward block; with SwiGLU, fc1 emits [gate; up] halves (Shazeer, GLU variants)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.swiglu = config.activation == "swiglu"
        self.gelu_approximate = config.gelu_approximate
        fc1_out = config.ffn_hidden_size * (2 if self.swiglu else 1)
        self.fc1 = nn.Linear(config.hidden_size, fc1_out, bias=config.add_bias_linear)
        self.fc2 = nn.Linear(config.ffn_hidden_size, config.hidden_size, bias=config.add_bias_linear)

    def forward(self, x):
        y = self.fc1(x)
        if self.swiglu:
            gate, up = y.chunk(2, dim=-1)
            y = F.silu(gate) * up
        else:
            y = F.gelu(y, approximate=self.gelu_approximate)
        return self.fc2(y)


class TransformerLayer(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.input_norm = make_norm(config)
        self.attention = Attention(config)
        self.attention_dropout = nn.Dropout(config.hidden_dropout)
        self.mlp_norm = make_norm(config)
        self.mlp = MLP(config)
        self.mlp_dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, x):
        x = x + self.attention_dropout(self.attention(self.input_norm(x)))
        return x + self.mlp_dropout(self.mlp(self.mlp_norm(x)))


class Embedding(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.word = nn.Embedding(config.padded_vocab_size, config.hidden_size)
        self.position = (nn.Embedding(config.max_position_embeddings, config.hidden_size)
                         if config.position_embedding == "learned" else None)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, tokens):
        x = self.word(tokens)
        if self.position is not None:
            x = x + self.position(torch.arange(tokens.shape[1], device=tokens.device))
        return self.dropout(x)


class LMHead(nn.Module):
    """Output projection to the (padded) vocabulary, and the per-token loss over the real vocabulary.

    Padding rows exist so the vocabulary splits evenly under tensor parallelism; they are cut off
    here (and masked in the parallel version) so padding never changes the loss.
    """

    def __init__(self, config: GPTConfig, weight: nn.Parameter | None = None):
        super().__init__()
        self.vocab_size = config.vocab_size
        self.weight = weight if weight is not None else nn.Parameter(
            torch.empty(config.padded_vocab_size, config.hidden_size))

    def forward(self, x, labels=None):
        logits = F.linear(x, self.weight)[..., :self.vocab_size]
        if labels is None:
            return logits
        losses = F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), reduction="none")
        return losses.view_as(labels)


class GPT(nn.Module):
    """forward(tokens | hidden, labels=None) -> per-token losses (b, s) | logits | hidden states.

    A pipeline stage without the embedding takes hidden states; one without the head returns them.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.embedding = Embedding(config)
        self.layers = nn.ModuleDict({str(i): TransformerLayer(config) for i in range(config.num_layers)})
        self.final_norm = make_norm(config)
        tied = self.embedding.word.weight if config.tie_embeddings else None
        self.output_head = LMHead(config, weight=tied)
        # Replaced by parallel.parallelize with a version that also restores TP RNG states.
        self.checkpoint_fn = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)

    def forward(self, inputs, labels=None):
        x = self.embedding(inputs) if self.embedding is not None else inputs
        for layer in self.layers.values():
            if self.config.recompute_activations and self.training:
                x = self.checkpoint_fn(layer, x)
            else:
                x = layer(x)
        if self.final_norm is not None:
            x = self.final_norm(x)
        if self.output_head is None:
            return x
        return self.output_head(x, labels)


# --- layout-independent initialisation ----------------------------------------------------------

def init_std(config: GPTConfig, name: str) -> float | None:
    """Std of a weight's normal init, None for ones (norm scales), 0 for zeros (biases).

    Output projections of residual branches are scaled by 1/sqrt(2L) (GPT-2's residual scaling).
    """
    if name.endswith(".bias"):
        return 0.0
    if "norm" in name.rsplit(".", 2)[-2]:
        return None
    if name.endswith(("attention.proj.weight", "mlp.fc2.weight")):
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
