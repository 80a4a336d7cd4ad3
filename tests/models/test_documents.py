"""models/documents.py and models/attention.py's varlen kernel: document masking equals its
definition.

- The tensors pack_documents builds (position ids, the attention mask its cu_seqlens and document
  numbers stand for, the loss mask) equal megatron-core's GPTDataset's, for 300 samples of one
  .bin/.idx and each of the 8 combinations of the three flags (skipped without megatron-core); the
  attention mask (Megatron's loop over s x s masks is slow) with all three on, where it is reset.
- A packed sample of documents gives the same per-token losses and the same gradients (fp32, rtol
  1e-5) as the documents run as separate samples with their own positions: RoPE with grouped-query
  attention, and learned positions; two samples a microbatch, a document cut by the sample's end.
- The per-document SDPA kernel (the CPU's) equals the written-out math with the dense mask (the
  oracle), outputs and q/k/v gradients, with grouped-query heads.
- Its per-document calls, recomputed in the backward, replay their attention dropout: outputs and
  gradients bitwise those of the same calls kept.

Mutations planted and seen failing (each by hand, then reverted):
- a document's eod counted in the next document (starts at the eod, not after it) -> the megatron
  comparison and packed-vs-separate (both) fail.
- positions not reset (reset_position_ids ignored in pack_documents) -> the megatron comparison and
  packed-vs-separate with learned positions fail (with RoPE, attention kept inside each document
  sees only relative positions: the reset changes nothing there, as it should).
- the per-document loop's last document dropped (bounds[:-2], bounds[1:-1]) -> the kernel check and
  packed-vs-separate fail.
- attention across documents (varlen_attention running plain causal attention) -> the kernel
  check and packed-vs-separate fail.
- the recomputation not replaying the random state (checkpointed calls with preserve_rng_state=False;
  then _PerDocument not restoring it) -> the dropout replay check fails (dq differs).
"""

import itertools
import warnings

import numpy as np
import pytest
import torch

from megazero.models.attention import attention_reference, causal_attention, core_attention, per_document_attention
from megazero.models.config import GPTConfig
from megazero.models.documents import DocumentMasking, Documents, pack_documents
from megazero.models.gpt import GPT, initial_value
from tests.data.tiny_data import write_dataset

EOD = 1
ALL = DocumentMasking(EOD, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)


def _megatron_samples(tmp_path, flags: dict, count: int, seq: int):
    """megatron-core's GPTDataset samples on a .bin/.idx of documents ending with EOD."""
    warnings.filterwarnings("ignore", module="megatron")
    gpt_dataset = pytest.importorskip(
        "megatron.core.datasets.gpt_dataset",
        reason="megatron-core is not installed (the oracle of Megatron's data semantics)",
    )
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.datasets.utils import Split

    prefix = tmp_path / "docs"
    if not prefix.with_suffix(".idx").exists():
        rng = np.random.default_rng(0)
        write_dataset(prefix, [list(rng.integers(2, 50, rng.integers(0, 40))) + [EOD] for _ in range(400)])

    class Tokenizer:  # what GPTDataset reads of one
        eod, vocab_size, unique_identifiers = EOD, 50, {"class": "Tokenizer"}

    config = gpt_dataset.GPTDatasetConfig(
        random_seed=1,
        sequence_length=seq,
        blend=None,
        split="1,0,0",
        tokenizer=Tokenizer(),
        path_to_cache=str(tmp_path / "cache"),
        create_attention_mask=all(flags.values()),
        **flags,
    )
    indexed = IndexedDataset(str(prefix))
    dataset = gpt_dataset.GPTDataset(
        indexed, str(prefix), np.arange(len(indexed), dtype=np.int32), count, Split.train, config
    )
    return [dataset[i] for i in range(count)]


def _dense_mask_from_bounds(bounds, b: int, s: int) -> torch.Tensor:
    """(b, s, s) bool, True where attention is blocked, from cu_seqlens alone."""
    blocked = torch.ones(b * s, b * s, dtype=torch.bool)
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        blocked[lo:hi, lo:hi] = torch.ones(hi - lo, hi - lo, dtype=torch.bool).triu(1)
    return torch.stack([blocked[i * s : (i + 1) * s, i * s : (i + 1) * s] for i in range(b)])


def test_tensors_equal_megatron_core_gpt_dataset(tmp_path):
    seq, count = 64, 300
    for values in itertools.product((False, True), repeat=3):
        flags = dict(zip(("reset_position_ids", "reset_attention_mask", "eod_mask_loss"), values))
        samples = _megatron_samples(tmp_path, flags, count, seq)
        inputs = torch.stack([s["tokens"] for s in samples])
        documents, loss_mask = pack_documents(inputs, DocumentMasking(EOD, **flags))
        expected = torch.stack([s["position_ids"] for s in samples])
        positions = (
            documents.positions
            if documents is not None and documents.positions is not None
            else torch.arange(seq).expand(count, seq)
        )
        assert torch.equal(positions, expected), f"{flags}: position ids"
        if all(values):
            blocked = torch.stack([s["attention_mask"][0] for s in samples])
            assert blocked.sum() > count * seq * (seq - 1) // 2, "the documents did block attention"
            assert torch.equal(_dense_mask_from_bounds(documents.bounds, count, seq), blocked), f"{flags}: mask"
            assert torch.equal(documents.cu_seqlens, torch.tensor(documents.bounds, dtype=torch.int32))
            assert torch.equal(~documents.visible()[:, 0], blocked), f"{flags}: document numbers"
        elif not flags["reset_attention_mask"]:  # Megatron's mask is then the plain causal one
            assert documents is None or not documents.separates_attention
        expected_loss = torch.stack([s["loss_mask"] for s in samples])
        assert torch.equal(loss_mask if loss_mask is not None else torch.ones(count, seq), expected_loss), (
            f"{flags}: loss mask"
        )


def _model(**extra) -> GPT:
    cfg = GPTConfig(
        vocab_size=50,
        hidden_size=32,
        num_layers=2,
        num_attention_heads=4,
        seq_length=24,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **extra,
    )
    model = GPT(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(initial_value(cfg, name, p.shape, seed=3))
    return model


def _documents_of(sample: torch.Tensor):
    """The documents of one packed sample (s + 1 tokens), each with the token after it: (inputs,
    labels) of the document run on its own."""
    inputs = sample[:-1]
    ends = (inputs == EOD).nonzero().flatten().tolist()
    starts = [0] + [e + 1 for e in ends if e + 1 < len(inputs)]
    stops = starts[1:] + [len(inputs)]
    return [(sample[a:b], sample[a + 1 : b + 1]) for a, b in zip(starts, stops)]


@pytest.mark.parametrize(
    "extra", [dict(position_embedding="rope", num_query_groups=2), {}], ids=["rope-gqa", "learned"]
)
def test_packed_documents_equal_separate_samples(extra):
    gen = torch.Generator().manual_seed(0)
    lengths = [[5, 9, 3, 8], [12, 4, 9]]  # tokens per document, eod included; cut at 25
    rows = []
    for doc_lengths in lengths:
        row = [torch.cat([torch.randint(2, 50, (n - 1,), generator=gen), torch.tensor([EOD])]) for n in doc_lengths]
        rows.append(torch.cat(row)[:25])
    tokens = torch.stack(rows)  # (2, 25): inputs and labels of 24
    packed = _model(**extra)
    documents, loss_mask = pack_documents(tokens[:, :-1], ALL)
    losses = packed(tokens[:, :-1], tokens[:, 1:], documents)
    (losses * loss_mask).sum().backward()

    separate = _model(**extra)
    pieces = []
    for sample in tokens:
        for inputs, labels in _documents_of(sample):
            loss = separate(inputs[None], labels[None])[0]
            keep = (inputs != EOD).float()
            (loss * keep).sum().backward()
            pieces.append(loss.detach())
    assert len(pieces) == 7
    expected = torch.cat(pieces).view(2, 24)
    kept = loss_mask.bool()
    torch.testing.assert_close(losses.detach()[kept], expected[kept], rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(packed.named_parameters(), separate.parameters()):
        scale = float(q.grad.abs().max())
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5 * scale, msg=lambda m: f"{name}: {m}")


def _random_documents(b: int, s: int, gen) -> Documents:
    tokens = torch.randint(2, 9, (b, s), generator=gen)
    tokens[torch.rand(b, s, generator=gen) < 0.15] = EOD
    return pack_documents(tokens, ALL)[0]


def test_per_document_kernel_equals_the_dense_mask():
    gen = torch.Generator().manual_seed(1)
    b, s, heads, groups, d = 2, 40, 4, 2, 8
    documents = _random_documents(b, s, gen)
    assert len(documents.bounds) > 6
    q = torch.randn(b, s, heads, d, generator=gen)
    k, v = (torch.randn(b, s, groups, d, generator=gen) for _ in range(2))
    dout = torch.randn(b, s, heads * d, generator=gen)
    results = []
    for kernel in ("per document", "dense mask", "core_attention"):
        qkv = [t.clone().requires_grad_() for t in (q, k, v)]
        if kernel == "per document":
            out = per_document_attention(*qkv, documents.bounds)
        elif kernel == "dense mask":
            out = attention_reference(*qkv, visible=documents.visible())
        else:
            out = core_attention(*qkv, documents=documents)
        out.backward(dout)
        results.append([out.detach()] + [t.grad for t in qkv])
    for got, oracle in ((results[0], results[1]), (results[2], results[1])):
        for name, a, e in zip(("out", "dq", "dk", "dv"), got, oracle):
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5 * float(e.abs().max()), msg=lambda m: f"{name}: {m}")


def test_per_document_recomputation_replays_dropout():
    """Each document's call is recomputed in the backward: with attention dropout its mask must be
    the forward's, so output and gradients equal the same calls run once, kept (the oracle)."""
    gen = torch.Generator().manual_seed(2)
    b, s, heads, d = 2, 32, 2, 8
    documents = _random_documents(b, s, gen)
    q, k, v = (torch.randn(b, s, heads, d, generator=gen) for _ in range(3))
    dout = torch.randn(b, s, heads * d, generator=gen)
    results = []
    for kernel in ("per document", "kept"):
        qkv = [t.clone().requires_grad_() for t in (q, k, v)]
        torch.manual_seed(7)
        if kernel == "per document":
            out = per_document_attention(*qkv, documents.bounds, dropout_p=0.3)
        else:
            flat = [t.flatten(0, 1).unsqueeze(0) for t in qkv]
            out = torch.cat(
                [
                    causal_attention(*(t[:, lo:hi] for t in flat), 0.3)
                    for lo, hi in zip(documents.bounds[:-1], documents.bounds[1:])
                ],
                1,
            ).view(b, s, -1)
        torch.manual_seed(99)  # the backward draws from another state
        out.backward(dout)
        results.append([out.detach()] + [t.grad for t in qkv])
    for name, a, e in zip(("out", "dq", "dk", "dv"), *results):
        torch.testing.assert_close(a, e, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
