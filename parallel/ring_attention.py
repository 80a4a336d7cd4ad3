"""Ring attention (context parallelism's `p2p` communication): causal attention of this rank's
queries over the whole sequence, whose keys and values travel around the context-parallel ring.

Owns the ring's autograd function and its block kernel. Must not know about TP, PP or ZeRO, nor
how the sequence was split: it is told this rank's index in the ring and assumes the layout of
`parallel.context_parallel` (rank i holds chunks i and 2N-1-i of 2N equal chunks, in that order).

The algorithm (Liu et al., "Ring Attention with Blockwise Transformers", 2023, with the
load-balanced causal split of Megatron-LM / Transformer Engine's context parallelism):
- Forward, step s = 0 .. N-1: rank i holds the K/V of rank src = (i - s) mod N and starts sending
  them to rank i+1 (and receiving rank i-s-1's from rank i-1) before computing on them, so the
  transfer overlaps the block's attention. Step 0 is causal attention over the local chunks. For
  src < i, both local query chunks see all of src's first chunk and none of its second; for src > i
  only the second local query chunk (2N-1-i) sees anything, and it sees both of src's chunks
  whole. So every step after the first is exactly half a block of unmasked work on every rank.
- Each block yields its output and the log-sum-exp (LSE) of its scores per query; blocks merge
  exactly: lse = logaddexp(lse_a, lse_b), out = out_a exp(lse_a - lse) + out_b exp(lse_b - lse).
- Backward: with the final output O and LSE, a block's probabilities are exp(S - LSE) directly
  (FlashAttention-2's backward), so each block's gradients need no re-merging. K/V travel the same
  ring again, and dK/dV accumulators travel with them: the holder of a block adds its share and
  passes it on; after N steps each accumulator arrives back at its owner, complete.

Packed documents (Megatron's --reset-attention-mask): each rank is handed every rank's tokens'
document numbers (the whole sample's, cut as the tokens are) and each block's scores are masked to
the pairs in one document, on top of the causal rule above; a block in which a query sees nothing
gives it a log-sum-exp of -inf, which merges as nothing (every query sees itself at step 0).

The block kernel is the attention math written out in fp32 (scores, mask, LSE, probabilities),
which holds a (local queries x block keys) score matrix per head: the oracle-grade kernel on CPU.
A fused kernel returning the LSE (FlashAttention's) would replace `_block_forward` /
`_block_backward` on GPUs; the ring, the merge and the communication stay as they are.
"""

from __future__ import annotations

import math

import torch

from megazero.core import comm
from megazero.core.comm import Group


def _expand(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(b, groups, s, d) -> (b, heads, s, d): key/value heads repeated for their query heads (GQA)."""
    groups = t.shape[1]
    return t if groups == heads else t.repeat_interleave(heads // groups, dim=1)


def _fold(t: torch.Tensor, groups: int) -> torch.Tensor:
    """The inverse of `_expand` for gradients: the query heads of a group sum into its K/V head."""
    b, heads, s, d = t.shape
    return t if groups == heads else t.view(b, groups, heads // groups, s, d).sum(dim=2)


def _scores(q, k, causal: bool, scale: float, same=None) -> torch.Tensor:
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:  # the local diagonal block: local chunks are in position order on both sides
        sq, sk = scores.shape[-2:]
        future = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    if same is not None:  # packed documents: (b, 1, sq, sk), True where both are in one document
        scores = scores.masked_fill(same.logical_not(), float("-inf"))
    return scores


def _block_forward(q, k, v, causal: bool, scale: float, same=None):
    """q (b, h, sq, d), k/v (b, g, sk, d), fp32 -> out (b, h, sq, d), lse (b, h, sq). A query that sees
    no key of the block (another document's) gets lse -inf and an output of 0."""
    heads = q.shape[1]
    scores = _scores(q, _expand(k, heads), causal, scale, same)
    lse = torch.logsumexp(scores, dim=-1)
    shift = lse if same is None else lse.masked_fill(lse.isneginf(), 0.0)  # exp(-inf - 0) = 0, not nan
    probs = torch.exp(scores - shift.unsqueeze(-1))
    return torch.matmul(probs, _expand(v, heads)), lse


def _block_backward(q, k, v, dout, lse, delta, causal: bool, scale: float, same=None):
    """Gradients of one block given the final LSE and delta = rowsum(dO * O): (dq, dk, dv)."""
    heads, groups = q.shape[1], k.shape[1]
    k_full, v_full = _expand(k, heads), _expand(v, heads)
    probs = torch.exp(_scores(q, k_full, causal, scale, same) - lse.unsqueeze(-1))
    dv = torch.matmul(probs.transpose(-1, -2), dout)
    dscores = probs * (torch.matmul(dout, v_full.transpose(-1, -2)) - delta.unsqueeze(-1))
    dq = torch.matmul(dscores, k_full) * scale
    dk = torch.matmul(dscores.transpose(-1, -2), q) * scale
    return dq, _fold(dk, groups), _fold(dv, groups)


def _merge(out, lse, block_out, block_lse) -> None:
    """Folds a block's (out, lse) into the running ones, in place (rows the block covers)."""
    merged = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - merged).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - merged).unsqueeze(-1))
    lse.copy_(merged)


def _step_plan(step: int, rank: int, size: int, chunk: int):
    """(query rows, key/value columns, causal) this rank computes at `step`: slices of its local
    2-chunk sequence and of the held block's."""
    everything = slice(None)
    if step == 0:
        return everything, everything, True
    source = (rank - step) % size
    if source < rank:
        return everything, slice(0, chunk), False
    return slice(chunk, None), everything, False


def _same_document(doc_ids, rank: int, step: int, size: int, rows: slice, cols: slice):
    """(b, 1, rows, cols) bool: which of the block's query/key pairs lie in one document; None
    without documents. `doc_ids` (size, b, local): each rank's tokens' document numbers."""
    if doc_ids is None:
        return None
    source = (rank - step) % size
    return (doc_ids[rank][:, rows].unsqueeze(-1) == doc_ids[source][:, cols].unsqueeze(-2)).unsqueeze(1)


def _pass_on(tensor: torch.Tensor, group: Group):
    """Sends `tensor` to the next rank of the ring and receives the previous rank's: (buffer, handle)."""
    received = torch.empty_like(tensor)
    handle = comm.send_recv(
        [(tensor, (group.rank + 1) % group.size)], [(received, (group.rank - 1) % group.size)], group
    )
    return received, handle


class RingAttention(torch.autograd.Function):
    """q (b, s, heads, d), k / v (b, s, groups, d) of this rank's two chunks -> (b, s, heads * d);
    `doc_ids` (size, b, s): every rank's tokens' document numbers (packed documents), or None."""

    @staticmethod
    def forward(ctx, q, k, v, group: Group, doc_ids=None):
        dtype = q.dtype
        qf = q.transpose(1, 2).float()
        kv = torch.stack([k.transpose(1, 2), v.transpose(1, 2)]).float().contiguous()
        scale, chunk = 1.0 / math.sqrt(q.shape[-1]), q.shape[1] // 2
        out = lse = None
        for step in range(group.size):
            pending = _pass_on(kv, group) if step < group.size - 1 else None
            rows, cols, causal = _step_plan(step, group.rank, group.size, chunk)
            same = _same_document(doc_ids, group.rank, step, group.size, rows, cols)
            block_out, block_lse = _block_forward(
                qf[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], causal, scale, same
            )
            if out is None:
                out, lse = block_out, block_lse
            else:
                _merge(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
            if pending is not None:
                kv, handle = pending
                handle.wait()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale, ctx.doc_ids = group, scale, doc_ids
        return out.to(dtype).transpose(1, 2).flatten(2)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        b, s, heads, d = q.shape
        qf = q.transpose(1, 2).float()
        dout = grad_out.view(b, s, heads, d).transpose(1, 2).float()
        delta = (dout * out).sum(dim=-1)
        dq = torch.zeros_like(qf)
        kv = torch.stack([k.transpose(1, 2), v.transpose(1, 2)]).float().contiguous()
        dkv, dkv_pending = torch.zeros_like(kv), None
        for step in range(group.size):
            kv_pending = _pass_on(kv, group) if step < group.size - 1 else None
            rows, cols, causal = _step_plan(step, group.rank, group.size, s // 2)
            same = _same_document(ctx.doc_ids, group.rank, step, group.size, rows, cols)
            block_dq, block_dk, block_dv = _block_backward(
                qf[:, :, rows],
                kv[0][:, :, cols],
                kv[1][:, :, cols],
                dout[:, :, rows],
                lse[:, :, rows],
                delta[:, :, rows],
                causal,
                scale,
                same,
            )
            dq[:, :, rows] += block_dq
            if dkv_pending is not None:  # the accumulator of the block held now
                dkv, handle = dkv_pending
                handle.wait()
            dkv[0][:, :, cols] += block_dk
            dkv[1][:, :, cols] += block_dv
            dkv_pending = _pass_on(dkv, group)  # on to the block's next holder (finally, its owner)
            if kv_pending is not None:
                kv, handle = kv_pending
                handle.wait()
        dkv, handle = dkv_pending
        handle.wait()
        dk, dv = (t.transpose(1, 2).to(k.dtype) for t in dkv)
        return dq.transpose(1, 2).to(q.dtype), dk, dv, None, None


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group, doc_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """Causal attention of this rank's two load-balanced chunks over the whole sequence; with
    `doc_ids` (size, b, s: every rank's tokens' document numbers) inside each document only."""
    return RingAttention.apply(q, k, v, group, doc_ids)
