"""A GPT-2 in plain PyTorch, the way a torch user writes one (nn.Linear, nn.LayerNorm, SDPA,
F.cross_entropy on the full logits): bench_gpu_step.py's peer, so that its ratio measures megazero's
model and engine against someone else's code.

No custom autograd Function anywhere: under `torch.autocast` every GEMM, forward and backward, runs
in the autocast dtype (autograd saves the casted inputs), which tests/test_bench_peers.py checks.
It loads a GPT-2 Hugging Face state dict (bench/peer_models.initial_hf_state: megazero's initial
weights through its export), so it computes megazero's GPT's function: GELU (tanh or erf), pre-LN,
learned positions, tied embeddings, biases, heads of hidden / heads.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from megazero.models.config import GPTConfig


def _checkpointed(fn, *args, **kwargs):
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **kwargs)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        h = cfg.hidden_size
        self.heads, self.approximate = cfg.num_attention_heads, cfg.gelu_approximate
        # "selective": the attention core recomputed in backward (Megatron's selective recomputation)
        self.attend = (
            functools.partial(_checkpointed, F.scaled_dot_product_attention)
            if cfg.recompute_granularity == "selective"
            else F.scaled_dot_product_attention
        )
        self.ln_1, self.ln_2 = nn.LayerNorm(h, eps=cfg.norm_epsilon), nn.LayerNorm(h, eps=cfg.norm_epsilon)
        self.c_attn, self.c_proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.c_fc, self.mlp_proj = nn.Linear(h, cfg.ffn_hidden_size), nn.Linear(cfg.ffn_hidden_size, h)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in self.c_attn(self.ln_1(x)).split(h, -1))
        y = self.attend(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(b, s, h))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate=self.approximate))


class PlainGPT(nn.Module):
    """forward(tokens, labels) -> per-token fp32 losses (b, s). `cfg.recompute_granularity` "full"
    checkpoints every block (torch.utils.checkpoint), "selective" each block's attention core."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.full_recompute = cfg.recompute_granularity == "full"
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.wpe = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_epsilon)

    def forward(self, tokens, labels):
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = _checkpointed(block, x) if self.full_recompute and self.training else block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # tied output layer
        losses = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")
        return losses.view_as(labels)

    def load_gpt2_state(self, state: dict[str, torch.Tensor]) -> None:
        """Loads transformers' GPT-2 names and layout (Conv1D weights are stored (in, out))."""
        rename = {
            "transformer.wte.": "wte.",
            "transformer.wpe.": "wpe.",
            "transformer.ln_f.": "ln_f.",
            "transformer.h.": "blocks.",
            ".attn.c_attn.": ".c_attn.",
            ".attn.c_proj.": ".c_proj.",
            ".mlp.c_fc.": ".c_fc.",
            ".mlp.c_proj.": ".mlp_proj.",
        }
        ours = {}
        for name, value in state.items():
            for old, new in rename.items():
                name = name.replace(old, new)
            conv1d = name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight", "mlp_proj.weight"))
            ours[name] = value.t() if conv1d else value
        self.load_state_dict(ours, strict=True)


def supports(cfg: GPTConfig) -> bool:
    """Whether PlainGPT computes `cfg`'s function (GPT-2's architecture, tied, heads of h / heads)."""
    return (
        cfg.position_embedding == "learned"
        and cfg.activation == "gelu"
        and cfg.normalization == "layernorm"
        and cfg.tie_embeddings
        and cfg.add_bias_linear
        and not cfg.apply_layernorm_1p
        and cfg.num_query_groups == cfg.num_attention_heads
        and cfg.head_dim * cfg.num_attention_heads == cfg.hidden_size
    )
