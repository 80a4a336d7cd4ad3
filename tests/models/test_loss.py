"""models/loss.py, the fused output layer + cross entropy (and parallel/cross_entropy.py, its
vocabulary-parallel form): loss and gradients of x and W against F.cross_entropy on the full logits,
for chunks of 1 token to all of them, within 1e-6 relative, in bf16 within bf16's rounding, and at
tp 2 with a rank that holds only padding rows (planted: dropping the `* in_range` mask fails tp 2).
"""

import pytest
import torch
import torch.nn.functional as F

from megazero.models.loss import linear_cross_entropy
from megazero.parallel.topology import Topology
from tests.models.test_attention import close


def _head_inputs(tokens=23, hidden=16, rows=40, vocab=37, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, tokens, hidden, generator=g)  # (b, s, h)
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

    assert chunk_tokens_for(512, 8192) == 512  # the benches' head: one chunk
    assert chunk_tokens_for(8 * 2048, 50304) * 50304 * 4 <= LOGITS_BUDGET_BYTES
    for tokens, vocab in ((8 * 2048, 50304), (16384, 128256), (4096, 1 << 20), (5000, 300_000)):
        chunk = chunk_tokens_for(tokens, vocab)
        chunks = -(-tokens // chunk)
        assert chunk >= MIN_CHUNK_TOKENS, (tokens, vocab)
        assert chunks * chunk - tokens < chunks, "chunks are equal but for rounding"
    assert chunk_tokens_for(4096, 1 << 20) == MIN_CHUNK_TOKENS  # the floor beats the budget
    assert chunk_tokens_for(100, 1 << 30, budget_bytes=1) == 100  # fewer tokens than the floor: one chunk


def test_chunked_cross_entropy_in_bf16_tracks_the_full_path():
    x, weight, labels, upstream = _head_inputs(tokens=64, hidden=32, rows=64, vocab=60)
    x, weight = x.bfloat16(), weight.bfloat16()
    ref_loss, ref_dx, ref_dw = _full_reference(x, weight, labels, 60, upstream)
    x, weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = linear_cross_entropy(x, weight, labels, 60, chunk_tokens=5)
    (loss * upstream).sum().backward()
    assert loss.dtype == torch.float32 and weight.grad.dtype == torch.bfloat16
    close(loss, ref_loss, "bf16 loss", rel=1e-6)  # same bf16 logits, fp32 softmax
    close(x.grad, ref_dx, "bf16 dx", rel=1e-2)
    close(weight.grad, ref_dw, "bf16 dW", rel=1e-2)


def vocab_parallel_ce(ctx, vocab, padded, chunk):
    from megazero.parallel.cross_entropy import vocab_parallel_linear_cross_entropy

    groups = ctx.groups(Topology(world_size=2, tp=2))
    x, full_weight, labels, upstream = _head_inputs(rows=padded, vocab=vocab)
    rows = padded // 2
    start = groups.coords.tp * rows
    weight = full_weight[start : start + rows].clone().requires_grad_()
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
        close(dw, ref_dw[start : start + padded // 2], f"tp 2 dW rows {start}..")  # all-padding rows: 0
    close(sum(r[1] for r in results), ref_dx, "tp 2 dx summed over ranks")
