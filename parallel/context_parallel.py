"""Context parallelism: each rank of the CP ring holds part of every sequence, and attention, the one
place tokens meet, is replaced from outside by a context-parallel one (Megatron-LM's
--context-parallel-size with --cp-comm-type; DeepSpeed-Ulysses' sequence parallelism is `a2a`).

Owns the sequence layout and the attention core's swap. Must not touch ZeRO, the loss or the data
source: the training step slices its tokens with `local_chunks`, gradients are reduced over the dp x
cp group the topology gives ZeRO, and everything else in a layer works on tokens independently.

The layout (load-balanced for the causal mask): a sequence is cut into 2N equal chunks and CP rank i
holds chunks i and 2N-1-i, in that order (a rank with early queries, which see few keys, also has
late ones, which see many). Embeddings and RoPE see the tokens' true positions through the model's
`positions` hooks, set here.

The three ways attention sees the whole sequence:
- `p2p` (ring attention, parallel.ring_attention): K/V blocks travel around the ring, blocks merge
  by their log-sum-exp. Nothing of size (sequence) is ever gathered.
- `a2a` (Ulysses): an all-to-all turns the sequence split into a head split (every rank gets the
  whole sequence of heads / N heads), ordinary causal attention runs, a second all-to-all turns it
  back. Needs heads and query groups divisible by N (x tp).
- `allgather`: K and V are all-gathered (their gradient reduce-scattered back) and the local queries
  attend with a mask built from true positions. The simple reference the other two are tested against.

Packed documents (models.documents.Documents, Megatron's --reset-attention-mask): every rank holds
the whole sample's tokens, so each builds the whole sample's Documents itself; nothing about them
is sent. Each core reads them in its own order: the ring masks each block by the document numbers of
the two ranks' chunks (`ring_document_ids`), Ulysses runs the varlen kernel over the gathered,
true-ordered sequence with the sample's own boundaries, allgather adds the documents to its mask.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from megazero.core import comm
from megazero.core.comm import Group
from megazero.models.attention import SDPA_HAS_GQA, core_attention
from megazero.models.gpt import GPT
from .random import TrackedModule
from .ring_attention import ring_attention


# --- the layout (pure) ---------------------------------------------------------------------------


def chunk_ids(cp_rank: int, cp: int) -> tuple[int, int]:
    """The two of 2*cp sequence chunks CP rank `cp_rank` holds, in its local order."""
    return cp_rank, 2 * cp - 1 - cp_rank


def local_chunks(x: torch.Tensor, cp_rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    """This rank's part of `x` along `dim` (the sequence): its two chunks, concatenated."""
    if cp == 1:
        return x
    chunks = x.chunk(2 * cp, dim=dim)
    first, second = chunk_ids(cp_rank, cp)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


@functools.lru_cache(maxsize=64)
def _positions(local_length: int, cp_rank: int, cp: int, device: torch.device) -> torch.Tensor:
    chunk = local_length // 2
    first, second = chunk_ids(cp_rank, cp)
    return torch.cat(
        [
            torch.arange(first * chunk, (first + 1) * chunk, device=device),
            torch.arange(second * chunk, (second + 1) * chunk, device=device),
        ]
    )


def local_positions(local_length: int, cp_rank: int, cp: int, device=None) -> torch.Tensor:
    """The true positions of this rank's `local_length` tokens (its two chunks)."""
    return _positions(local_length, cp_rank, cp, torch.device(device or "cpu"))


def ring_positions(local_length: int, cp: int, device=None) -> torch.Tensor:
    """True positions of the sequence gathered rank by rank (rank 0's tokens, then rank 1's, ...)."""
    return torch.cat([local_positions(local_length, r, cp, device) for r in range(cp)])


# --- the communication, each op with its autograd inverse ----------------------------------------


def _all_to_all(x: torch.Tensor, group: Group) -> torch.Tensor:
    """x (N, ...): slot j goes to rank j; slot j of the result came from rank j."""
    x = x.contiguous()  # (empty_like keeps a permuted view's strides; the op needs rows)
    out = torch.empty_like(x)
    comm.all_to_all(out, x, group)
    return out


def _seq_to_heads(x: torch.Tensor, group: Group) -> torch.Tensor:
    """(b, L, H, d) -> (b, N*L, H/N, d): the whole sequence (ranks' parts in rank order), 1/N of heads."""
    n = group.size
    parts = x.unflatten(2, (n, x.shape[2] // n)).permute(2, 0, 1, 3, 4)
    return _all_to_all(parts, group).permute(1, 0, 2, 3, 4).flatten(1, 2)


def _heads_to_seq(y: torch.Tensor, group: Group) -> torch.Tensor:
    """The inverse of `_seq_to_heads`: (b, N*L, H/N, d) -> (b, L, H, d)."""
    n = group.size
    parts = y.unflatten(1, (n, y.shape[1] // n)).permute(1, 0, 2, 3, 4)
    return _all_to_all(parts, group).permute(1, 2, 0, 3, 4).flatten(2, 3)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad, ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group):
        ctx.group = group
        return _heads_to_seq(y, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad, ctx.group), None


class _GatherSequence(torch.autograd.Function):
    """(b, L, ...) -> (b, N*L, ...), ranks' parts in rank order; backward: the gradient summed over
    the ring and each rank's part scattered back to it."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.new_empty((group.size,) + tuple(x.shape))
        comm.all_gather(out, x.contiguous(), group)
        return out.movedim(0, 1).flatten(1, 2)

    @staticmethod
    def backward(ctx, grad):
        group = ctx.group
        parts = grad.unflatten(1, (group.size, grad.shape[1] // group.size)).movedim(1, 0).contiguous()
        out = grad.new_empty(parts.shape[1:])
        comm.reduce_scatter(out, parts, group)
        return out, None


# --- the attention cores --------------------------------------------------------------------------


def ulysses_attention(q, k, v, group: Group, dropout_p: float = 0.0, backend: str = "auto", documents=None):
    """a2a: heads scattered, sequence gathered, causal attention in true order (inside each of
    `documents`' documents, whole-sample boundaries), and back."""
    local = q.shape[1]
    order = ring_positions(local, group.size, q.device)  # gathered index -> true position
    to_true = torch.argsort(order)
    q, k, v = (_SeqToHeads.apply(t, group).index_select(1, to_true) for t in (q, k, v))
    out = core_attention(q, k, v, dropout_p, backend, documents)  # (b, S, heads/N * d), true order
    out = out.index_select(1, order).unflatten(2, (q.shape[2], q.shape[3]))
    return _HeadsToSeq.apply(out, group).flatten(2)


# Two entries (a training and an evaluation length): each is a (seq/cp x seq) device tensor, kept
# for the process's life once built.
@functools.lru_cache(maxsize=2)
def _visible_bias(local_length: int, cp_rank: int, cp: int, device: torch.device, dtype) -> torch.Tensor:
    """(local, N*local) additive mask of this rank's queries over the gathered keys: 0 where the key's
    true position is at or before the query's, -inf after. One tensor for every layer and
    microbatch: SDPA saves a float mask it is given as it is, but turns a boolean one into a float
    copy per call, which autograd then holds until the layer's backward (measured on the CPU:
    layers x local x N*local x 4 bytes more at the step's peak)."""
    query_pos = local_positions(local_length, cp_rank, cp, device)
    key_pos = ring_positions(local_length, cp, device)
    hidden = key_pos.unsqueeze(0) > query_pos.unsqueeze(1)
    return torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))


def _document_bias(documents, local_length: int, cp_rank: int, cp: int, dtype) -> torch.Tensor:
    """(b, 1, local, N*local) additive mask of this rank's queries over the gathered keys for packed
    documents: 0 where the key is in the query's document at or before it. Built once per microbatch
    (the record's memo) and shared by every layer, as `_visible_bias` is."""
    key = ("allgather_bias", local_length, cp_rank, cp, dtype)
    if key not in documents.memo:
        ids = documents.doc_ids
        query_pos = local_positions(local_length, cp_rank, cp, ids.device)
        key_pos = ring_positions(local_length, cp, ids.device)
        other = ids.index_select(1, query_pos).unsqueeze(-1) != ids.index_select(1, key_pos).unsqueeze(-2)
        hidden = (key_pos.unsqueeze(0) > query_pos.unsqueeze(1)) | other
        documents.memo[key] = (
            torch.zeros(hidden.shape, dtype=dtype, device=ids.device).masked_fill_(hidden, float("-inf")).unsqueeze(1)
        )
    return documents.memo[key]


def ring_document_ids(documents, local_length: int, cp: int) -> torch.Tensor:
    """(cp, b, local): the document numbers of each CP rank's tokens (its two chunks), for the ring's
    blocks; once per microbatch."""
    key = ("ring_ids", local_length, cp)
    if key not in documents.memo:
        documents.memo[key] = torch.stack(
            [
                documents.doc_ids.index_select(1, local_positions(local_length, r, cp, documents.doc_ids.device))
                for r in range(cp)
            ]
        )
    return documents.memo[key]


def allgather_attention(q, k, v, group: Group, dropout_p: float = 0.0, documents=None):
    """allgather: local queries over all-gathered K/V, masked by true positions (and documents)."""
    if documents is not None and documents.separates_attention:
        bias = _document_bias(documents, q.shape[1], group.rank, group.size, q.dtype)
    else:
        bias = _visible_bias(q.shape[1], group.rank, group.size, q.device, q.dtype)
    k, v = (_GatherSequence.apply(t, group) for t in (k, v))
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if k.shape[1] != q.shape[1] and not SDPA_HAS_GQA:
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    extra = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p, **extra)
    return out.transpose(1, 2).flatten(2)


class ContextParallelAttention(nn.Module):
    """The attention core (q, k, v -> out) over a sequence split across `group` (see the module doc)."""

    def __init__(self, group: Group, comm_type: str, dropout: float, backend: str = "auto"):
        super().__init__()
        self.group, self.comm_type, self.dropout, self.backend = group, comm_type, dropout, backend

    def forward(self, q, k, v, documents=None):
        dropout = self.dropout if self.training else 0.0
        if self.comm_type == "p2p":
            if dropout:
                raise ValueError("ring attention (cp_comm_type p2p) has no attention dropout")
            separate = documents is not None and documents.separates_attention
            ids = ring_document_ids(documents, q.shape[1], self.group.size) if separate else None
            return ring_attention(q, k, v, self.group, ids)
        if self.comm_type == "a2a":
            return ulysses_attention(q, k, v, self.group, dropout, self.backend, documents)
        return allgather_attention(q, k, v, self.group, dropout, documents)


def apply_context_parallel(model: GPT, group: Group, comm_type: str) -> GPT:
    """Swaps every layer's attention core for a context-parallel one over `group` and points the
    embedding's and attention's position hooks at this rank's true positions (in place)."""
    if group.size == 1:
        return model
    if comm_type == "p2p":  # NCCL: a collective before the first batched send/recv of a communicator
        comm.all_reduce(torch.zeros(1, device=group.device), group)
    positions = functools.partial(_rank_positions, cp_rank=group.rank, cp=group.size)
    if model.embedding is not None:
        model.embedding.positions = positions
    for layer in model.layers.values():
        attention = layer.attention
        attention.positions = positions
        holder = attention.core.inner if isinstance(attention.core, TrackedModule) else attention.core
        cp_core = ContextParallelAttention(group, comm_type, holder.dropout, holder.backend)
        if isinstance(attention.core, TrackedModule):
            attention.core.inner = cp_core
        else:
            attention.core = cp_core
    return model


def _rank_positions(length: int, device, *, cp_rank: int, cp: int) -> torch.Tensor:
    return local_positions(length, cp_rank, cp, device)
