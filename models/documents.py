"""Packed samples: where the documents of a microbatch lie, as Megatron-LM's GPTDataset defines them
(--reset-position-ids, --reset-attention-mask, --eod-mask-loss), in the form the model takes.

Owns `DocumentMasking` (the three switches and the end-of-document id), `Documents` (what the model
takes: each token's position, the documents' boundaries as cumulative lengths over the flattened
microbatch, each token's document number) and `pack_documents` (input tokens -> Documents and the
loss mask, computed on the host from the tokens alone). Pure torch, no parallelism: the attention
kernel that keeps each document to itself is models/attention.py's, and context parallelism reads the
same record, whole, on every rank (its shards index it by their tokens' true positions).

Megatron's definitions (megatron.core.datasets.gpt_dataset), for input tokens x (b, s) and the
end-of-document id eod:
- a document ends at an eod, inclusive: the token after an eod starts the next document;
- reset_position_ids: a token's position is its distance from its document's first token;
- reset_attention_mask: a query sees the keys of its own document at or before it (block-diagonal
  causal attention);
- eod_mask_loss: no loss where the input token is eod (its label is the next document's first token).
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class DocumentMasking:
    """Megatron's three switches and the end-of-document token they look for."""

    eod: int
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False

    @property
    def changes_the_model(self) -> bool:
        """Whether the model sees anything (positions or attention) other than plain causal order."""
        return self.reset_position_ids or self.reset_attention_mask


@dataclasses.dataclass
class Documents:
    """The documents of one microbatch of b samples of s tokens, whole (never a shard of it).

    positions: (b, s) int64, each token's position in its document; None: 0 .. s-1 (positions run on
    across documents). cu_seqlens: (n + 1,) int32, the first token of each of the n documents of the
    microbatch flattened to b * s tokens, then b * s (FlashAttention's varlen convention; a sample's
    start is always a boundary); None: attention spans documents. bounds: the same numbers on the
    host, and max_seqlen the longest document, for the kernels that loop or size by them.
    doc_ids: (b, s) int32, each token's document number over the flattened microbatch (present with
    cu_seqlens), for kernels that mask by it (ring attention's blocks, FlexAttention, the written-out
    math). memo: tensors derived once per forward and shared by every layer (the rotary tables at
    the documents' positions, a context-parallel mask), so that autograd saves one copy, not one per
    layer; GPT.forward runs on a `fresh()` copy, so they live as long as that forward's graph."""

    positions: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    doc_ids: torch.Tensor | None = None
    bounds: tuple[int, ...] = ()
    max_seqlen: int = 0
    memo: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @property
    def separates_attention(self) -> bool:
        return self.cu_seqlens is not None

    def fresh(self) -> "Documents":
        """The same tensors with an empty memo."""
        return dataclasses.replace(self, memo={})

    def to(self, copy) -> "Documents":
        """The same record with its tensors passed through `copy(tensor) -> tensor` (onto a device)."""
        move = lambda t: None if t is None else copy(t)
        return Documents(move(self.positions), move(self.cu_seqlens), move(self.doc_ids), self.bounds, self.max_seqlen)

    def token_positions(self, index: torch.Tensor | None) -> torch.Tensor:
        """(b, L) positions of the tokens at true indices `index` (L,) of the sample (None: all)."""
        return self.positions if index is None else self.positions.index_select(1, index)

    def rotary_tables(self, cos: torch.Tensor, sin: torch.Tensor, index: torch.Tensor | None):
        """RoPE's (length, d) tables read at the positions of the tokens at `index`: (b, L, d) each,
        built once per microbatch for every layer (the same `index` for every layer of a rank)."""
        length = self.positions.shape[1] if index is None else index.numel()
        key = ("rotary", length, cos.dtype, cos.device)
        if key not in self.memo:
            positions = self.token_positions(index)
            self.memo[key] = (cos[positions], sin[positions])
        return self.memo[key]

    def visible(self) -> torch.Tensor:
        """(b, 1, s, s) bool: query i sees key j (same document, j <= i). The dense mask, for the
        written-out math only (the oracle; built once per forward); the kernels never build it."""
        if "visible" not in self.memo:
            s = self.doc_ids.shape[1]
            causal = torch.ones(s, s, dtype=torch.bool, device=self.doc_ids.device).tril()
            same = self.doc_ids.unsqueeze(-1) == self.doc_ids.unsqueeze(-2)
            self.memo["visible"] = (same & causal).unsqueeze(1)
        return self.memo["visible"]


def document_starts(inputs: torch.Tensor, eod: int) -> torch.Tensor:
    """(b, s) bool: True where a token starts a document (the first token, and every token after an
    eod)."""
    starts = torch.zeros_like(inputs, dtype=torch.bool)
    starts[:, 0] = True
    starts[:, 1:] = inputs[:, :-1] == eod
    return starts


def pack_documents(inputs: torch.Tensor, masking: DocumentMasking) -> tuple[Documents | None, torch.Tensor | None]:
    """(Documents, loss mask) of input tokens `inputs` (b, s) on the host: the Documents the model
    takes (None when neither positions nor attention change), and the (b, s) float loss mask (None
    without eod_mask_loss). Megatron's definitions, in the module docstring."""
    inputs = inputs.cpu()
    b, s = inputs.shape
    loss_mask = (inputs != masking.eod).float() if masking.eod_mask_loss else None
    if not masking.changes_the_model:
        return None, loss_mask
    starts = document_starts(inputs, masking.eod)
    doc_ids = starts.flatten().cumsum(0).sub_(1).view(b, s)  # document number, flattened order
    flat_starts = starts.flatten().nonzero().flatten()
    bounds = flat_starts.tolist() + [b * s]
    documents = Documents(bounds=tuple(bounds), max_seqlen=int(torch.tensor(bounds).diff().max()))
    if masking.reset_position_ids:
        index = torch.arange(b * s)
        first = index.sub(flat_starts.repeat_interleave(torch.tensor(bounds).diff()))
        documents.positions = first.view(b, s)
    if masking.reset_attention_mask:
        documents.cu_seqlens = torch.tensor(bounds, dtype=torch.int32)
        documents.doc_ids = doc_ids.to(torch.int32)
    return documents, loss_mask
