"""The model's kernels against the paths they replaced and against independent statements of their
meaning (fp32 unless said otherwise):

- core attention: SDPA's enable_gqa and every --attention-backend against the repeat_interleave path
  it replaced and the written-out math; planted bug: pairing query head h with key head h % groups
  (repeat instead of repeat_interleave where the key/value heads are expanded) fails the fused,
  unfused and local cases with GQA and the written-out math's own check;
- RoPE: the cached tables and one-expression rotation are bitwise the old per-layer tables and
  strided stack, in fp32 and bf16; --rotary-percent rotates the leading dims as a complex-number
  rotation says (planted: rotating the trailing dims instead fails);
- the fused output layer + cross entropy: loss and gradients of x and W against F.cross_entropy on
  the full logits, for chunks of 1 token to all of them, within 1e-6 relative, and at tp 2 with a
  rank that holds only padding rows (planted: dropping the `* in_range` mask fails tp 2);
- zero-centred norms equal the plain norm with weight + 1 (planted: `+ 1` dropped fails);
- selective recomputation gives the same loss and gradients as none, and recomputes the core only.
"""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megazero.models.attention import RotaryTables, attention_reference, core_attention, rotate
from megazero.models.config import GPTConfig
from megazero.models.gpt import GPT, CoreAttention, ZeroCenteredLayerNorm, ZeroCenteredRMSNorm, initial_value
from megazero.models.loss import linear_cross_entropy
from megazero.parallel.topology import Topology

REL = 1e-6


def close(actual, expected, what, rel=REL):
    actual, expected = actual.detach(), expected.detach()
    scale = float(expected.abs().max())
    gap = float((actual.double() - expected.double()).abs().max())
    assert gap <= rel * scale, f"{what}: differs by {gap / scale:.2e} of its largest value"


# --- the paths these kernels replaced, kept as oracles ---------------------------------------------

def old_core_attention(q, k, v):
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if k.shape[1] != q.shape[1]:
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)


def old_rotary_cos_sin(seq_len, head_dim, base, dtype):
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def old_apply_rotary(x, cos, sin):
    x1, x2 = x[..., 0::2], x[..., 1::2]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


# --- attention ------------------------------------------------------------------------------------

def _qkv(heads, groups, d=8, b=2, s=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, n, d, generator=g, requires_grad=True) for n in (heads, groups, groups)]


@pytest.mark.parametrize("backend", ["auto", "flash", "fused", "unfused", "local"])
@pytest.mark.parametrize("heads,groups", [(4, 4), (8, 2), (6, 1)])
def test_attention_backends_match_the_repeat_interleave_path(backend, heads, groups):
    q, k, v = _qkv(heads, groups)
    out = core_attention(q, k, v, 0.0, backend)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    ref = old_core_attention(q, k, v)
    ref_grads = torch.autograd.grad((ref * weights).sum(), (q, k, v))
    close(out, ref, f"{backend} {heads}/{groups} output")
    for name, got, want in zip("qkv", grads, ref_grads):
        close(got, want, f"{backend} {heads}/{groups} d{name}")


def test_written_out_attention_is_softmax_of_scaled_scores():
    """An independent statement: out_h = softmax(q_h k_g^T / sqrt(d) + causal mask) v_g, g = h // (H/G)."""
    q, k, v = (t.detach().double() for t in _qkv(6, 2, d=5, b=1, s=7))
    out = attention_reference(q, k, v).view(1, 7, 6, 5)
    for h in range(6):
        g = h // 3
        scores = q[0, :, h] @ k[0, :, g].T / math.sqrt(5)
        scores = scores + torch.full((7, 7), float("-inf"), dtype=torch.double).triu(1)
        torch.testing.assert_close(out[0, :, h], scores.softmax(-1) @ v[0, :, g], rtol=1e-12, atol=1e-12)


# --- rotary ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cached_rotation_is_bitwise_the_old_rotation(dtype):
    head_dim, s = 16, 11
    tables = RotaryTables(head_dim, head_dim, 500.0)
    cos, sin = tables.get(20, "cpu", dtype)
    assert tables.get(20, "cpu", dtype)[0] is cos, "tables are built once per (length, device, dtype)"
    x = torch.randn(3, s, 5, head_dim).to(dtype)
    old_cos, old_sin = old_rotary_cos_sin(s, head_dim, 500.0, dtype)
    assert torch.equal(rotate(x, cos, sin), old_apply_rotary(x, old_cos, old_sin))
    grouped = x.view(3, s, 5, 1, head_dim)        # the model rotates (b, s, groups, q+k, d) at once
    assert torch.equal(rotate(grouped, cos, sin).view_as(x), old_apply_rotary(x, old_cos, old_sin))


def test_rotary_percent_rotates_the_leading_dims_as_complex_numbers():
    head_dim, rot, s, base = 12, 6, 9, 10000.0
    cos, sin = RotaryTables(head_dim, rot, base).get(s, "cpu", torch.float32)
    x = torch.randn(2, s, 3, head_dim)
    pairs = torch.view_as_complex(x[..., :rot].double().unflatten(-1, (-1, 2)).contiguous())
    theta = base ** (-torch.arange(0, rot, 2, dtype=torch.double) / rot)
    phase = torch.polar(torch.ones(s, rot // 2, dtype=torch.double), torch.arange(s).double()[:, None] * theta)
    expected = torch.cat([torch.view_as_real(pairs * phase[None, :, None]).flatten(-2), x[..., rot:].double()], -1)
    close(rotate(x, cos, sin), expected, "partial rotary")
    assert torch.equal(rotate(x, cos, sin)[..., rot:], x[..., rot:]), "the trailing dims pass through"


# --- the fused output layer and loss --------------------------------------------------------------

def _head_inputs(tokens=23, hidden=16, rows=40, vocab=37, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, tokens, hidden, generator=g)                # (b, s, h)
    weight = torch.randn(rows, hidden, generator=g) * 0.5
    weight[vocab:] = 0.0
    labels = torch.randint(0, vocab, x.shape[:-1], generator=g)
    upstream = torch.rand(labels.shape, generator=g)
    return x, weight, labels, upstream


def _full_reference(x, weight, labels, vocab, upstream):
    x, weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
    logits = F.linear(x, weight)[..., :vocab]
    loss = F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), reduction="none").view_as(labels)
    (loss * upstream).sum().backward()
    return loss.detach(), x.grad, weight.grad


@pytest.mark.parametrize("chunk", [1, 4, 7, None, 10_000])
def test_chunked_cross_entropy_matches_the_full_logits(chunk):
    x, weight, labels, upstream = _head_inputs()
    vocab = 37
    ref_loss, ref_dx, ref_dw = _full_reference(x, weight, labels, vocab, upstream)
    x, weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = linear_cross_entropy(x, weight, labels, vocab, chunk_tokens=chunk)
    (loss * upstream).sum().backward()
    close(loss, ref_loss, f"chunk {chunk}: loss")
    close(x.grad, ref_dx, f"chunk {chunk}: dx")
    close(weight.grad, ref_dw, f"chunk {chunk}: dW")
    assert torch.all(weight.grad[vocab:] == 0), "padding rows get no gradient"


def test_chunking_is_one_chunk_under_the_budget_and_thousands_of_tokens_above():
    from megazero.models.loss import LOGITS_BUDGET_BYTES, MIN_CHUNK_TOKENS, chunk_tokens_for
    assert chunk_tokens_for(512, 8192) == 512                    # the benches' head: one chunk
    assert chunk_tokens_for(8 * 2048, 50304) * 50304 * 4 <= LOGITS_BUDGET_BYTES
    for tokens, vocab in ((8 * 2048, 50304), (16384, 128256), (4096, 1 << 20), (5000, 300_000)):
        chunk = chunk_tokens_for(tokens, vocab)
        chunks = -(-tokens // chunk)
        assert chunk >= MIN_CHUNK_TOKENS, (tokens, vocab)
        assert chunks * chunk - tokens < chunks, "chunks are equal but for rounding"
    assert chunk_tokens_for(4096, 1 << 20) == MIN_CHUNK_TOKENS   # the floor beats the budget
    assert chunk_tokens_for(100, 1 << 30, budget_bytes=1) == 100  # fewer tokens than the floor: one chunk


def test_chunked_cross_entropy_in_bf16_tracks_the_full_path():
    x, weight, labels, upstream = _head_inputs(tokens=64, hidden=32, rows=64, vocab=60)
    x, weight = x.bfloat16(), weight.bfloat16()
    ref_loss, ref_dx, ref_dw = _full_reference(x, weight, labels, 60, upstream)
    x, weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = linear_cross_entropy(x, weight, labels, 60, chunk_tokens=5)
    (loss * upstream).sum().backward()
    assert loss.dtype == torch.float32 and weight.grad.dtype == torch.bfloat16
    close(loss, ref_loss, "bf16 loss", rel=1e-6)                  # same bf16 logits, fp32 softmax
    close(x.grad, ref_dx, "bf16 dx", rel=1e-2)
    close(weight.grad, ref_dw, "bf16 dW", rel=1e-2)


def vocab_parallel_ce(ctx, vocab, padded, chunk):
    from megazero.parallel.cross_entropy import vocab_parallel_linear_cross_entropy
    groups = ctx.groups(Topology(world_size=2, tp=2))
    x, full_weight, labels, upstream = _head_inputs(rows=padded, vocab=vocab)
    rows = padded // 2
    start = groups.coords.tp * rows
    weight = full_weight[start:start + rows].clone().requires_grad_()
    x = x.clone().requires_grad_()
    loss = vocab_parallel_linear_cross_entropy(x, weight, labels, groups.tp, start, vocab, chunk)
    (loss * upstream).sum().backward()
    return loss.detach(), x.grad, weight.grad, start


@pytest.mark.parametrize("vocab,padded,chunk", [(37, 40, 3), (37, 40, None), (15, 40, 4)])
def test_vocab_parallel_chunked_cross_entropy_at_tp2(dist_pool, vocab, padded, chunk):
    """(15, 40): rank 1 holds vocabulary rows 20..39, all padding."""
    x, weight, labels, upstream = _head_inputs(rows=padded, vocab=vocab)
    ref_loss, ref_dx, ref_dw = _full_reference(x, weight, labels, vocab, upstream)
    results = dist_pool(2).run(vocab_parallel_ce, vocab, padded, chunk)
    for loss, dx_part, dw, start in results:
        close(loss, ref_loss, "tp 2 loss")
        close(dw, ref_dw[start:start + padded // 2], f"tp 2 dW rows {start}..")   # all-padding rows: 0
    close(sum(r[1] for r in results), ref_dx, "tp 2 dx summed over ranks")


# --- norms and recomputation ----------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_zero_centred_norm_is_the_norm_with_weight_plus_one(kind):
    x = torch.randn(3, 5, 16)
    weight = torch.randn(16) * 0.1
    one_p = ZeroCenteredLayerNorm(16) if kind == "layernorm" else ZeroCenteredRMSNorm(16)
    plain = nn.LayerNorm(16) if kind == "layernorm" else nn.RMSNorm(16)
    with torch.no_grad():
        one_p.weight.copy_(weight)
        plain.weight.copy_(weight + 1)
        if kind == "layernorm":
            one_p.bias.normal_()
            plain.bias.copy_(one_p.bias)
    assert torch.equal(one_p(x), plain(x))
    cfg = GPTConfig(vocab_size=11, hidden_size=16, num_attention_heads=2, apply_layernorm_1p=True)
    assert torch.equal(initial_value(cfg, "layers.0.input_norm.weight", (16,), 0), torch.zeros(16)), \
        "a zero-centred scale starts at 0 (the norm multiplies by 1)"


def test_selective_recomputation_equals_none_and_reruns_the_core_only():
    base = dict(vocab_size=29, hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
                seq_length=10, hidden_dropout=0.0, attention_dropout=0.0, position_embedding="rope")
    models = [GPT(GPTConfig(**base, recompute_granularity=g)) for g in ("none", "selective")]
    for name, p in models[0].named_parameters():
        p.data = initial_value(models[0].config, name, p.shape, 3) + 0.01 * torch.randn(p.shape)
    models[1].load_state_dict(models[0].state_dict())
    tokens = torch.randint(0, 29, (3, 11), generator=torch.Generator().manual_seed(2))
    calls = []
    hook = nn.modules.module.register_module_forward_pre_hook(
        lambda m, a: calls.append(type(m).__name__) if isinstance(m, CoreAttention) else None)
    try:
        losses = []
        for model in models:
            calls.clear()
            loss = model(tokens[:, :-1], tokens[:, 1:]).sum()
            loss.backward()
            losses.append((loss.detach(), calls.count("CoreAttention")))
    finally:
        hook.remove()
    assert torch.equal(losses[0][0], losses[1][0])
    assert (losses[0][1], losses[1][1]) == (2, 4), "selective: each layer's core runs again in backward"
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        assert torch.equal(a.grad, b.grad), name
