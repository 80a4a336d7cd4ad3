"""Attention's two kernels as plain functions: the rotary position embedding and the core attention
(q, k, v -> out). Pure torch on any device; no parameters, no parallelism.

`core_attention` is the one place the attention math happens, so that context parallelism (ring
attention) can swap it for a function of the same signature. `rotate` applies RoPE to the leading
`rotary_dim` dims of each head with tables that `RotaryTables` builds once per (length, device,
dtype) and keeps for the run.

Packed documents (models/documents.py, Megatron's --reset-attention-mask): `core_attention` given a
`Documents` record that separates attention runs `varlen_attention`, block-diagonal causal attention
from the documents' boundaries, which never builds a (s x s) mask: on the CPU one SDPA call per
document (torch's FlexAttention runs eager there, materialising the whole (s x s) scores, and has no
backward on the CPU: bench/README.md); on CUDA FlashAttention's varlen kernel (the flash_attn package,
16-bit inputs) or FlexAttention with a block mask (`cuda_varlen_attention`, not run on this project's
CPU machines); the written-out math (the oracle) with the dense mask.

Conventions (kept from the first implementation; tests/models/test_attention.py holds it as the oracle):
- RoPE rotates the interleaved pairs (x[2i], x[2i+1]) by angle pos * base^(-2i / rotary_dim)
  (RoFormer's form; models/hf_adapter.py permutes rows to Llama's halves on export and import).
  With rotary_percent < 1 only the first rotary_dim dims of a head rotate (Megatron-LM's choice); the
  tables hold cos 1 and sin 0 beyond them, so one expression covers every head dim.
- Grouped-query attention pairs query head h with key/value head h // (heads / groups).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

try:
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError:  # torch < 2.3: no backend choice, SDPA picks
    SDPBackend = sdpa_kernel = None

# SDPA's enable_gqa (key/value heads broadcast inside the kernel) arrived in torch 2.5.
SDPA_HAS_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)
# --attention-backend -> the SDPA kernels it allows, by device type (None: SDPA chooses freely).
# "fused" is Megatron's Transformer Engine cuDNN kernel: torch's cuDNN and memory-efficient kernels on
# CUDA; on CPU the only fused kernel torch has is its flash one. "unfused" and "local" are the math
# written out (`attention_reference`), with no SDPA call at all.
_SDPA_KERNELS = {
    "flash": {"cuda": ("FLASH_ATTENTION",), "cpu": ("FLASH_ATTENTION",)},
    "fused": {"cuda": ("CUDNN_ATTENTION", "EFFICIENT_ATTENTION"), "cpu": ("FLASH_ATTENTION",)},
}
WRITTEN_OUT = ("unfused", "local")


class RotaryTables:
    """cos / sin tables (length, head_dim) for RoPE, built once per (length, device, dtype).

    Row p, columns 2i and 2i+1 hold cos / sin of p * base^(-2i / rotary_dim) for 2i < rotary_dim; the
    sin table carries the sign of the rotation (-sin on even columns), and the columns past
    rotary_dim hold cos 1, sin 0. Angles are computed in fp32 and rounded to the compute dtype once.
    Plain Python, not a module: no state dict entry, nothing for ZeRO to partition.
    """

    def __init__(self, head_dim: int, rotary_dim: int, base: float):
        self.head_dim, self.rotary_dim, self.base = head_dim, rotary_dim, base
        self._cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, length: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = (length, torch.device(device), dtype)
        if key not in self._cache:
            self._cache[key] = self._build(length, torch.device(device), dtype)
        return self._cache[key]

    def _build(self, length: int, device, dtype):
        rot = self.rotary_dim
        inv_freq = 1.0 / (self.base ** (torch.arange(0, rot, 2, device=device, dtype=torch.float32) / rot))
        angles = torch.outer(torch.arange(length, device=device, dtype=torch.float32), inv_freq)
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        pad = self.head_dim - rot
        cos = torch.cat([cos.repeat_interleave(2, dim=-1), cos.new_ones(length, pad)], dim=-1)
        signed = torch.stack([-sin, sin], dim=-1).flatten(-2)
        return cos, torch.cat([signed, sin.new_zeros(length, pad)], dim=-1)


def rotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """RoPE on x (b, s, ..., head_dim) with RotaryTables' (>= s, head_dim) tables: one expression,
    x * cos + pair_swap(x) * sin, where pair_swap exchanges x[2i] and x[2i+1]. In eager mode the
    products and the sum round exactly as the pairwise formula does (a negated sin is exact).
    `positions` (s,): the tokens' positions in the sequence when x holds only some of them (context
    parallelism); None: 0 .. s-1. Tables of shape (b, s, head_dim) are already read at each token's
    position (packed documents: models.documents.Documents.rotary_tables)."""
    s = x.shape[1]
    if cos.dim() == 3:
        lead = tuple(cos.shape[:2])
    elif positions is None:
        cos, sin, lead = cos[:s], sin[:s], (1, s)
    else:
        cos, sin, lead = cos.index_select(0, positions), sin.index_select(0, positions), (1, s)
    shape = lead + (1,) * (x.dim() - 3) + (x.shape[-1],)
    cos, sin = cos.view(shape), sin.view(shape)
    swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return x * cos + swapped * sin


def _kernels(backend: str, device_type: str):
    names = _SDPA_KERNELS.get(backend, {}).get(device_type)
    if names is None or sdpa_kernel is None:
        return None
    return [getattr(SDPBackend, n) for n in names]


def core_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0, backend: str = "auto", documents=None
) -> torch.Tensor:
    """Causal attention of q (b, s, heads, d) over k, v (b, s, groups, d) -> (b, s, heads * d).
    `documents` (models.documents.Documents) that separate attention: each query sees only the keys
    of its own document (`varlen_attention`)."""
    if documents is not None and documents.separates_attention:
        return varlen_attention(q, k, v, documents, dropout_p, backend)
    return causal_attention(q, k, v, dropout_p, backend)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0, backend: str = "auto"
) -> torch.Tensor:
    """Causal attention over the whole sequence (no documents): SDPA with `backend`'s kernels, or the
    written-out math."""
    if backend in WRITTEN_OUT:
        return attention_reference(q, k, v, dropout_p)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (b, heads, s, d)
    # The cuDNN / memory-efficient kernels take no enable_gqa: they get the key/value heads expanded.
    gqa = k.shape[1] != q.shape[1]
    native_gqa = gqa and SDPA_HAS_GQA and backend != "fused"
    if gqa and not native_gqa:
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    extra = {"enable_gqa": True} if native_gqa else {}
    kernels = _kernels(backend, q.device.type)
    if kernels is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p, **extra)
    else:
        with sdpa_kernel(kernels):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p, **extra)
    return out.transpose(1, 2).flatten(2)


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents, dropout_p: float = 0.0, backend: str = "auto"
) -> torch.Tensor:
    """Block-diagonal causal attention from `documents`' boundaries: q (b, s, heads, d), k, v
    (b, s, groups, d) -> (b, s, heads * d). The written-out math takes the dense mask (the oracle);
    CUDA its fused varlen kernels where they apply; everything else one causal SDPA call per
    document, recomputed in the backward: it keeps the concatenated output only (one call over the
    whole sequence keeps its output and, with the flash kernel, one log-sum-exp per query) and
    never builds an (s x s) mask."""
    if backend in WRITTEN_OUT:
        return attention_reference(q, k, v, dropout_p, visible=documents.visible())
    if q.device.type == "meta":
        # meta stands in for a GPU (the dry run; as weight_grad.matmul_fp32): CUDA's varlen kernels
        # keep what one causal call over the whole sequence keeps, its output and log-sum-exp
        return causal_attention(q, k, v, dropout_p, backend)
    if q.device.type == "cuda":
        out = cuda_varlen_attention(q, k, v, documents, dropout_p)
        if out is not None:
            return out
    return per_document_attention(q, k, v, documents.bounds, dropout_p, backend)


def per_document_attention(q, k, v, bounds, dropout_p: float = 0.0, backend: str = "auto") -> torch.Tensor:
    """`causal_attention` on each document [bounds[i], bounds[i + 1]) of the batch flattened to
    b * s tokens (a sample's tokens are consecutive there), written into one output. Under autograd
    `_PerDocument` keeps nothing of the calls and recomputes them in the backward, one at a time."""
    b, s = q.shape[:2]
    # (b, s) merge into one dimension without a copy: q, k, v are views of one projection's rows.
    q, k, v = (t.flatten(0, 1).unsqueeze(0) for t in (q, k, v))
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out = _PerDocument.apply(q, k, v, tuple(bounds), dropout_p, backend)
    else:
        out = _each_document(q, k, v, bounds, dropout_p, backend)
    return out.view(b, s, -1)


def _each_document(q, k, v, bounds, dropout_p: float, backend: str) -> torch.Tensor:
    out = q.new_empty(1, q.shape[1], q.shape[2] * v.shape[3])
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        out[:, lo:hi] = causal_attention(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], dropout_p, backend)
    return out


class _PerDocument(torch.autograd.Function):
    """The per-document calls as one autograd node. Each call's backward needs what its kernel kept
    (its output and log-sum-exp, or the math kernel's probabilities): kept for every document they
    would be a second copy of the output beside the one the projection keeps, and autograd's
    slicing of q, k, v would add a whole zero-filled gradient per document. So the forward keeps
    q, k, v only; the backward recomputes one document at a time (the forward's random state
    restored, so its dropout is replayed) and writes its gradients into whole dq, dk, dv."""

    @staticmethod
    def forward(ctx, q, k, v, bounds, dropout_p, backend):
        ctx.bounds, ctx.dropout_p, ctx.backend = bounds, dropout_p, backend
        ctx.rng = _rng_state(q.device) if dropout_p > 0 else None
        ctx.save_for_backward(q, k, v)
        return _each_document(q, k, v, bounds, dropout_p, backend)

    @staticmethod
    def backward(ctx, grad):
        q, k, v = ctx.saved_tensors
        grads = [torch.empty_like(t) for t in (q, k, v)]
        cuda = [q.device] if q.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda, enabled=ctx.rng is not None):
            if ctx.rng is not None:
                _set_rng_state(q.device, ctx.rng)
            for lo, hi in zip(ctx.bounds[:-1], ctx.bounds[1:]):
                with torch.enable_grad():
                    inputs = [t[:, lo:hi].detach().requires_grad_() for t in (q, k, v)]
                    out = causal_attention(*inputs, ctx.dropout_p, ctx.backend)
                for whole, piece in zip(grads, torch.autograd.grad(out, inputs, grad[:, lo:hi])):
                    whole[:, lo:hi] = piece
        return (*grads, None, None, None)


def _rng_state(device):
    return torch.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


def _set_rng_state(device, state) -> None:
    torch.set_rng_state(state[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(state[1], device)


def cuda_varlen_attention(q, k, v, documents, dropout_p: float = 0.0):
    """On CUDA: FlashAttention-2's varlen kernel (the flash_attn package; fp16 / bf16), else torch's
    FlexAttention compiled with a block mask of the documents (no dropout; the mask built once per
    microbatch); None when neither applies (the caller loops over documents). Written to the
    packages' documented signatures and not run on this project's CPU machines."""
    b, s = q.shape[:2]
    if q.dtype in (torch.float16, torch.bfloat16):
        try:
            from flash_attn import flash_attn_varlen_func
        except ImportError:
            flash_attn_varlen_func = None
        if flash_attn_varlen_func is not None:
            cu, longest = documents.cu_seqlens, documents.max_seqlen
            out = flash_attn_varlen_func(
                q.flatten(0, 1),
                k.flatten(0, 1),
                v.flatten(0, 1),
                cu,
                cu,
                longest,
                longest,
                dropout_p=dropout_p,
                causal=True,
            )
            return out.view(b, s, -1)
    flex = _compiled_flex_attention()
    if flex is None or dropout_p:
        return None
    from torch.nn.attention.flex_attention import create_block_mask

    key = ("block_mask", q.device)
    if key not in documents.memo:
        ids = documents.doc_ids

        def same_document_causal(batch, head, query, key_index):
            return (ids[batch, query] == ids[batch, key_index]) & (key_index <= query)

        documents.memo[key] = create_block_mask(same_document_causal, b, None, s, s, device=q.device)
    out = flex(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        block_mask=documents.memo[key],
        enable_gqa=k.shape[2] != q.shape[2],
    )
    return out.transpose(1, 2).flatten(2)


@functools.lru_cache(maxsize=1)
def _compiled_flex_attention():
    """torch.compile(flex_attention) once per process; None where torch has no FlexAttention."""
    try:
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError:
        return None
    return torch.compile(flex_attention, dynamic=False)


def attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0, visible: torch.Tensor | None = None
):
    """The math written out (Megatron's local DotProductAttention): scores, causal mask, softmax in
    (at least) fp32, dropout on the probabilities, weighted sum. Holds the (b, heads, s, s) scores.
    `visible` (b, 1, s, s) bool: the keys each query sees (packed documents), instead of causal."""
    heads, groups, d = q.shape[2], k.shape[2], q.shape[-1]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if groups != heads:
        k, v = k.repeat_interleave(heads // groups, dim=1), v.repeat_interleave(heads // groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(d))
    s = q.shape[2]
    future = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1) if visible is None else ~visible
    softmax_dtype = torch.promote_types(q.dtype, torch.float32)  # at least fp32
    probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1, dtype=softmax_dtype).to(q.dtype)
    if dropout_p:
        probs = F.dropout(probs, dropout_p)
    return torch.matmul(probs, v).transpose(1, 2).flatten(2)


# torch's SDPBackend numbering, as torch._fused_sdp_choice answers it
_CHOICE_NAMES = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}


def attention_kernel(
    device, dtype, heads: int, groups: int, head_dim: int, dropout_p: float, backend: str = "auto"
) -> str:
    """The kernel `core_attention` runs for a training forward of these shapes on `device`:
    "written_out" (attention_reference), or the one torch's SDPA picks ("math", "flash", "efficient",
    "cudnn"), asked of torch itself on a tiny tensor of the same dtype, heads and head size (its pick
    does not depend on the length). The math kernel keeps (b, heads, s, s) probabilities; the others
    O(s)."""
    if backend in WRITTEN_OUT:
        return "written_out"
    device = torch.device(device)
    if device.type == "meta" or not hasattr(torch, "_fused_sdp_choice"):
        return "unknown"
    native_gqa = groups != heads and SDPA_HAS_GQA and backend != "fused"
    kv_heads = groups if native_gqa else heads
    q = torch.zeros(1, heads, 8, head_dim, dtype=dtype, device=device, requires_grad=True)
    k, v = (torch.zeros(1, kv_heads, 8, head_dim, dtype=dtype, device=device, requires_grad=True) for _ in "kv")
    extra = {"enable_gqa": True} if native_gqa else {}
    kernels = _kernels(backend, device.type)
    if kernels is None:
        choice = torch._fused_sdp_choice(q, k, v, None, dropout_p, True, **extra)
    else:
        with sdpa_kernel(kernels):
            choice = torch._fused_sdp_choice(q, k, v, None, dropout_p, True, **extra)
    return _CHOICE_NAMES.get(int(choice), "unknown")
