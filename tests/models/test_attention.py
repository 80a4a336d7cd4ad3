"""models/attention.py against the paths it replaced and against independent statements of its
meaning (fp32 unless said otherwise):

- core attention: SDPA's enable_gqa and every --attention-backend against the repeat_interleave path
  it replaced and the written-out math; planted bug: pairing query head h with key head h % groups
  (repeat instead of repeat_interleave where the key/value heads are expanded) fails the fused,
  unfused and local cases with GQA and the written-out math's own check;
- RoPE: the cached tables and one-expression rotation are bitwise the old per-layer tables and
  strided stack, in fp32 and bf16; --rotary-percent rotates the leading dims as a complex-number
  rotation says (planted: rotating the trailing dims instead fails).
tests/gpu/test_model_kernels_cuda.py runs the CUDA backends.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from megazero.models.attention import RotaryTables, attention_reference, core_attention, rotate

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
    grouped = x.view(3, s, 5, 1, head_dim)  # the model rotates (b, s, groups, q+k, d) at once
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
