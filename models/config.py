"""The GPT model's shape and options, as one typed record (no parallel layout in here).

Invalid shapes raise ValueError with the offending flag named; the driver turns it into a one-line error.
"""
from __future__ import annotations

import dataclasses
from typing import Literal


@dataclasses.dataclass
class GPTConfig:
    vocab_size: int                        # the tokenizer's vocabulary
    hidden_size: int = 256
    num_layers: int = 4
    num_attention_heads: int = 4
    num_query_groups: int = 0              # 0: one group per head (multi-head attention)
    ffn_hidden_size: int = 0               # 0: 4 x hidden (GELU) or 8/3 x hidden rounded to 64 (SwiGLU)
    seq_length: int = 256
    max_position_embeddings: int = 0      # 0: seq_length (rows of the learned position table)
    padded_vocab_size: int = 0             # 0: vocab_size; the embedding has this many rows
    position_embedding: Literal["learned", "rope"] = "learned"
    rotary_base: float = 10000.0
    activation: Literal["gelu", "swiglu"] = "gelu"
    # GELU's form, as torch's F.gelu(approximate=...): "tanh" is GPT-2's (and Megatron's fused bias-GELU),
    # "none" the exact erf form; only used when activation is "gelu".
    gelu_approximate: Literal["tanh", "none"] = "tanh"
    normalization: Literal["layernorm", "rmsnorm"] = "layernorm"
    norm_epsilon: float = 1e-5
    tie_embeddings: bool = True
    add_bias_linear: bool = True
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    recompute_activations: bool = False
    init_method_std: float = 0.02

    def __post_init__(self):
        if self.num_query_groups == 0:
            self.num_query_groups = self.num_attention_heads
        if self.ffn_hidden_size == 0:
            if self.activation == "swiglu":
                self.ffn_hidden_size = 64 * ((8 * self.hidden_size // 3 + 63) // 64)
            else:
                self.ffn_hidden_size = 4 * self.hidden_size
        if self.padded_vocab_size == 0:
            self.padded_vocab_size = self.vocab_size
        if self.max_position_embeddings == 0:
            self.max_position_embeddings = self.seq_length
        self.validate()

    def validate(self) -> None:
        positive = ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "seq_length")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"--hidden-size {self.hidden_size} is not divisible by "
                             f"--num-attention-heads {self.num_attention_heads}")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(f"--num-attention-heads {self.num_attention_heads} is not divisible by "
                             f"--num-query-groups {self.num_query_groups}")
        head_dim = self.hidden_size // self.num_attention_heads
        if self.position_embedding == "rope" and head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head size, got {head_dim}")
        if self.gelu_approximate not in ("tanh", "none"):
            raise ValueError(f"gelu_approximate must be 'tanh' or 'none', got {self.gelu_approximate!r}")
        if self.padded_vocab_size < self.vocab_size:
            raise ValueError(f"padded vocab {self.padded_vocab_size} < vocab {self.vocab_size}")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1), got {getattr(self, name)}")


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel: int) -> int:
    """Rounds the vocabulary up to a multiple of divisible_by x tp (Megatron's rule)."""
    multiple = divisible_by * tensor_parallel
    return ((vocab_size + multiple - 1) // multiple) * multiple
