"""Incremental decoding for the pure GPT: a key/value cache per layer, so each new token costs one
position's work instead of the whole prefix's, and the choice of the next token (greedy, or sampled
with temperature, top-k and top-p).

`forward_cached` runs the model's own modules (embedding, norms, projections, MLP, head) and repeats
only the attention's bookkeeping: the fused QKV's group layout, the rotary tables' rows at each
token's absolute position, and attention over the cached keys and values. Its oracle is GPT.forward: the
logits at every position equal the full forward's (tests/tools/test_generate.py). Inference only (no
dropout, no gradients). Like the rest of `models`, imports neither `parallel` nor `megazero`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange

from .attention import rotate
from .gpt import GPT, Attention


class KVCache:
    """Each layer's keys and values so far, (batch, positions, query groups, head size)."""

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    @property
    def length(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[1]

    def extend(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys[layer] is not None:
            keys = torch.cat([self.keys[layer], keys], dim=1)
            values = torch.cat([self.values[layer], values], dim=1)
        self.keys[layer], self.values[layer] = keys, values
        return keys, values


def _attention(attention: Attention, x: torch.Tensor, cache: KVCache, layer: int, start: int, rotary) -> torch.Tensor:
    """Attention.forward for tokens at positions start.. given the cache of the positions before;
    `rotary` is the model's (cos, sin) tables (None without RoPE)."""
    qkv = rearrange(attention.qkv(x), "b s (g r d) -> b s g r d", r=attention.q_per_group + 2, d=attention.head_dim)
    qk = qkv[:, :, :, :-1]
    if rotary is not None:  # the rows of these positions: the angles the full forward uses
        qk = rotate(qk, rotary[0][start:], rotary[1][start:])
    q = rearrange(qk[:, :, :, :-1], "b s g r d -> b s (g r) d")
    k, v = cache.extend(layer, qk[:, :, :, -1], qkv[:, :, :, -1])
    new = x.shape[1]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (b, heads, s, d)
    if k.shape[1] != q.shape[1]:  # grouped-query attention
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    # query j (position start + j) sees keys 0 .. start + j
    visible = (
        torch.arange(start + new, device=x.device)[None, :] <= (start + torch.arange(new, device=x.device))[:, None]
    )
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible)
    return attention.proj(out.transpose(1, 2).flatten(2))


@torch.no_grad()
def forward_cached(model: GPT, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits (batch, new tokens, vocab) of `tokens` (batch, new tokens), which follow the positions
    already in `cache`; the cache is extended with them."""
    start = cache.length
    x = model.embedding.word(tokens)
    if model.embedding.position is not None:
        x = x + model.embedding.position(torch.arange(start, start + tokens.shape[1], device=tokens.device))
    rotary = None
    if model.rotary is not None:
        length = max(model.config.max_position_embeddings, start + tokens.shape[1])
        rotary = model.rotary.get(length, x.device, x.dtype)
    for index, layer in enumerate(model.layers.values()):
        x = x + _attention(layer.attention, layer.input_norm(x), cache, index, start, rotary)
        x = x + layer.mlp(layer.mlp_norm(x))
    return model.output_head(model.final_norm(x))


def sampling_logits(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """logits / temperature, -inf outside the top_k most likely tokens (0: all) and outside the
    smallest set of most likely tokens whose probability reaches top_p (1: all), in that order, as
    transformers' TemperatureLogitsWarper, TopKLogitsWarper and TopPLogitsWarper do."""
    logits = logits.float() / temperature
    if 0 < top_k < logits.numel():
        logits = logits.masked_fill(logits < torch.topk(logits, top_k).values[-1], float("-inf"))
    if top_p < 1.0:
        ordered, order = torch.sort(logits, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        beyond = torch.cumsum(probs, dim=-1) - probs >= top_p  # the first token always stays
        logits = logits.masked_fill(torch.zeros_like(beyond).scatter(0, order, beyond), float("-inf"))
    return logits


def next_token(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> int:
    """The next token from one position's logits (vocab,): the most likely at temperature 0, else a
    draw from the softmax of sampling_logits."""
    if temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(sampling_logits(logits, temperature, top_k, top_p), dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def generate(
    model: GPT,
    prompt: list[int],
    max_new_tokens: int,
    stop: int | None = None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> list[int]:
    """Up to `max_new_tokens` ids after `prompt` (the `stop` id ends it and is included), one
    position at a time after the prompt's single pass."""
    device = model.embedding.word.weight.device
    # learned positions end at the table's last row; rotary ones go on
    limit = model.config.max_position_embeddings if model.embedding.position is not None else None
    cache = KVCache(len(model.layers))
    logits = forward_cached(model, torch.tensor([prompt], device=device), cache)[0, -1]
    out: list[int] = []
    while len(out) < max_new_tokens:
        out.append(next_token(logits, temperature, top_k, top_p, generator))
        if out[-1] == stop or len(out) == max_new_tokens or (limit is not None and len(prompt) + len(out) > limit):
            break  # feeding the token back would need position len(prompt) + len(out) - 1
        logits = forward_cached(model, torch.tensor([[out[-1]]], device=device), cache)[0, -1]
    return out
