"""The GPT model's shape and options, as one typed record (no parallel layout in here).

Invalid shapes raise ValueError with the offending flag named; the driver turns it into a one-line error.
Field meanings follow Megatron-LM's flags of the same name (docs/flags.md).
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional, Union

from .moe_config import moe_layer_pattern, validate_moe

ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")
RECOMPUTE_GRANULARITIES = ("none", "selective", "full")


@dataclasses.dataclass
class GPTConfig:
    vocab_size: int  # the tokenizer's vocabulary
    hidden_size: int = 256
    num_layers: int = 4
    num_attention_heads: int = 4
    num_query_groups: int = 0  # 0: one group per head (multi-head attention)
    kv_channels: int = 0  # each head's width; 0: hidden / heads (Megatron's default)
    ffn_hidden_size: int = 0  # 0: 4 x hidden (GELU) or 8/3 x hidden rounded to 64 (SwiGLU)
    seq_length: int = 256
    max_position_embeddings: int = 0  # 0: seq_length (rows of the learned position table)
    padded_vocab_size: int = 0  # 0: vocab_size; the embedding has this many rows
    position_embedding: Literal["learned", "rope"] = "learned"
    rotary_base: float = 10000.0
    # Fraction of each head's dims RoPE rotates: the first int(head_dim x percent), as Megatron-LM.
    rotary_percent: float = 1.0
    activation: Literal["gelu", "swiglu"] = "gelu"
    # GELU's form, as torch's F.gelu(approximate=...): "tanh" is GPT-2's (and Megatron's fused bias-GELU),
    # "none" the exact erf form; only used when activation is "gelu".
    gelu_approximate: Literal["tanh", "none"] = "tanh"
    normalization: Literal["layernorm", "rmsnorm"] = "layernorm"
    norm_epsilon: float = 1e-5
    # Zero-centred norm scale (Megatron's --apply-layernorm-1p): the norm multiplies by weight + 1,
    # weight starts at 0 (LayerNorm and RMSNorm alike, as Transformer Engine's zero_centered_gamma).
    apply_layernorm_1p: bool = False
    tie_embeddings: bool = True
    add_bias_linear: bool = True
    # Biases in the QKV projection alone (Megatron-LM's --add-qkv-bias, Qwen's attention): on top of
    # add_bias_linear, which puts them in every linear layer.
    add_qkv_bias: bool = False
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    # Which SDPA kernels attention may use ("local"/"unfused": the math written out; models/attention.py).
    attention_backend: Literal["auto", "flash", "fused", "unfused", "local"] = "auto"
    # Activation recomputation, as Megatron-LM's flags: "selective" recomputes the core attention
    # (softmax(qk^T)v) of every layer; "full" whole layers, chosen by recompute_method:
    # "uniform" checkpoints groups of recompute_num_layers consecutive layers (only each group's input
    # is kept), "block" checkpoints the first recompute_num_layers layers of each model chunk (pipeline
    # stage) one by one and runs the rest without recomputation.
    recompute_granularity: Literal["none", "selective", "full"] = "none"
    recompute_method: Optional[Literal["uniform", "block"]] = None
    recompute_num_layers: int = 0
    init_method_std: float = 0.02
    # Mixture of experts (models/moe.py; Megatron-LM's --num-experts and --moe-* flags, same meanings,
    # checked in models/moe_config.py). 0 experts: every layer dense.
    num_experts: int = 0
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int = 0  # each expert's width; 0: ffn_hidden_size
    moe_router_load_balancing_type: str = "aux_loss"  # aux_loss, seq_aux_loss, none
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float = 0.0
    moe_router_score_function: str = "softmax"  # softmax, sigmoid
    moe_router_pre_softmax: bool = False  # softmax over all experts before the top-k
    moe_router_topk_scaling_factor: Optional[float] = None
    moe_router_enable_expert_bias: bool = False  # DeepSeek-V3's aux-loss-free balancing
    moe_router_bias_update_rate: float = 1e-3
    moe_router_dtype: Optional[str] = None  # the router GEMM's dtype: None (activations'), fp32, fp64
    moe_expert_capacity_factor: Optional[float] = None  # None: dropless
    moe_pad_expert_input_to_capacity: bool = False
    moe_token_drop_policy: str = "probs"  # probs, position
    moe_shared_expert_intermediate_size: int = 0  # 0: no shared expert
    moe_shared_expert_gate: bool = False  # the shared expert's output x sigmoid(x . gate) (Qwen2-MoE)
    moe_layer_freq: Union[int, list] = 1  # every N-th layer MoE, or one 0/1 per layer
    moe_grouped_gemm: bool = False  # torch._grouped_mm where it runs, else a loop
    # A checkpoint's model record written before recompute_granularity existed says this instead;
    # True meant every layer recomputed whole (full, uniform, one layer per group). Not stored.
    recompute_activations: dataclasses.InitVar[Optional[bool]] = None

    def __post_init__(self, recompute_activations=None):
        if recompute_activations and self.recompute_granularity == "none":
            self.recompute_granularity, self.recompute_method, self.recompute_num_layers = "full", "uniform", 1
        if self.num_query_groups == 0:
            self.num_query_groups = self.num_attention_heads
        if self.ffn_hidden_size == 0:
            if self.activation == "swiglu":
                self.ffn_hidden_size = 64 * ((8 * self.hidden_size // 3 + 63) // 64)
            else:
                self.ffn_hidden_size = 4 * self.hidden_size
        if self.moe_ffn_hidden_size == 0:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        if self.padded_vocab_size == 0:
            self.padded_vocab_size = self.vocab_size
        if self.max_position_embeddings == 0:
            self.max_position_embeddings = self.seq_length
        heads = self.num_attention_heads
        if self.kv_channels == 0 and heads > 0 and self.hidden_size % heads == 0:
            self.kv_channels = self.hidden_size // heads  # Megatron's default head size
        self.validate()

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer `index` (global) is a mixture of experts."""
        return self.num_experts > 0 and bool(moe_layer_pattern(self.moe_layer_freq, self.num_layers)[index])

    @property
    def head_dim(self) -> int:
        """Each attention head's width (Megatron's kv_channels)."""
        return self.kv_channels

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each head RoPE rotates (0 without RoPE)."""
        return int(self.head_dim * self.rotary_percent) if self.position_embedding == "rope" else 0

    def validate(self) -> None:
        positive = ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "seq_length")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.kv_channels < 0:
            raise ValueError(f"--kv-channels must be >= 1, got {self.kv_channels}")
        if not self.kv_channels:
            raise ValueError(
                f"--hidden-size {self.hidden_size} is not divisible by "
                f"--num-attention-heads {self.num_attention_heads}; set --kv-channels "
                f"(the head size) or change one of them"
            )
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"--num-attention-heads {self.num_attention_heads} is not divisible by "
                f"--num-query-groups {self.num_query_groups}"
            )
        self._validate_rotary()
        self._validate_recompute()
        validate_moe(self)
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"--attention-backend {self.attention_backend!r}: choose one of {', '.join(ATTENTION_BACKENDS)}"
            )
        if self.gelu_approximate not in ("tanh", "none"):
            raise ValueError(f"gelu_approximate must be 'tanh' or 'none', got {self.gelu_approximate!r}")
        if self.padded_vocab_size < self.vocab_size:
            raise ValueError(f"padded vocab {self.padded_vocab_size} < vocab {self.vocab_size}")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1), got {getattr(self, name)}")

    def _validate_rotary(self) -> None:
        if not 0.0 < self.rotary_percent <= 1.0:
            raise ValueError(f"--rotary-percent must be in (0, 1], got {self.rotary_percent}")
        if self.position_embedding != "rope":
            return
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(
                f"rotary embeddings rotate pairs of dims: head size {self.head_dim} x "
                f"--rotary-percent {self.rotary_percent} = {self.rotary_dim} dims must be even "
                f"and >= 2"
            )

    def _validate_recompute(self) -> None:
        """Megatron-LM's rules: full needs a method and a layer count >= 1; selective takes neither."""
        granularity, method, layers = self.recompute_granularity, self.recompute_method, self.recompute_num_layers
        if granularity not in RECOMPUTE_GRANULARITIES:
            raise ValueError(f"--recompute-granularity {granularity!r}: choose selective or full")
        if method not in (None, "uniform", "block"):
            raise ValueError(f"--recompute-method {method!r}: choose uniform or block")
        if granularity == "full" and (method is None or layers < 1):
            missing = "--recompute-method uniform|block" if method is None else "--recompute-num-layers N >= 1"
            raise ValueError(f"--recompute-granularity full needs {missing}")
        if granularity != "full" and (method is not None or layers):
            given = f"--recompute-method {method}" if method is not None else f"--recompute-num-layers {layers}"
            raise ValueError(
                f"{given} needs --recompute-granularity full"
                + (" (selective recomputes the core attention of every layer)" if granularity == "selective" else "")
            )


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel: int) -> int:
    """Rounds the vocabulary up to a multiple of divisible_by x tp (Megatron's rule)."""
    multiple = divisible_by * tensor_parallel
    return ((vocab_size + multiple - 1) // multiple) * multiple
