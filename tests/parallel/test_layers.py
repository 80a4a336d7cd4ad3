"""TP layers at tp=2 and tp=4 against nn.Linear / nn.Embedding / F.cross_entropy, elementwise.

Every rank builds the same full reference module from a fixed seed, cuts its shard with the layer's
own TPShard, runs forward and backward on the same data, and compares outputs, input gradients and
its slice of the weight gradients with the reference (fp32, rtol 1e-5).
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megazero.parallel.finalize import plain_grads, sum_sequence_parallel_grads
from megazero.parallel.layers import (
    ColumnParallelLinear,
    ParallelEmbedding,
    ParallelLMHead,
    RowParallelLinear,
    SequenceParallelNorm,
    VocabParallelEmbedding,
)
from megazero.parallel.mappings import scatter_to_sequence_region
from megazero.parallel.topology import Topology
from megazero.models.param_info import param_info, set_param_info

RTOL = 1e-5
B, S, H = 2, 8, 16


def close(actual, expected, what):
    """Elementwise rtol 1e-5; entries that are sums cancelling to near zero get an absolute floor of
    rtol x the tensor's largest entry (a split sum can't match a near-zero total more closely)."""
    atol = RTOL * float(expected.abs().max())
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=atol, msg=lambda m: f"{what}: {m}")


def _inputs(seed, *shape):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


def _shard_seq(x, group, sp):
    return scatter_to_sequence_region(x, group) if sp else x


def check_column_row(group, sp):
    for chunks in (1, 2):
        ref = nn.Linear(H, 4 * H)
        ref.weight.data, ref.bias.data = _inputs(1, 4 * H, H), _inputs(2, 4 * H)
        col = ColumnParallelLinear(H, 4 * H, True, group, sp, chunks=chunks, gather_output=True)
        col.weight.data = param_info(col.weight).tp_shard.local_from_full(ref.weight.data)
        col.bias.data = param_info(col.bias).tp_shard.local_from_full(ref.bias.data)
        x = _inputs(3, B, S, H).requires_grad_()
        x_local = _shard_seq(x.detach(), group, sp).requires_grad_()
        y_ref = ref(x)
        y = col(x_local)
        if chunks == 2:  # gathered output is [rank0 gate|up, rank1 gate|up...]; reorder to compare
            y = _regroup(y, group.size, chunks)
        close(y, y_ref, f"column(sp={sp}, chunks={chunks}) output")
        grad_out = _inputs(4, *y_ref.shape)
        y_ref.backward(grad_out)
        y.backward(grad_out)
        close(x_local.grad, _shard_seq(x.grad, group, sp), "column input grad")
        close(col.weight.grad, param_info(col.weight).tp_shard.local_from_full(ref.weight.grad), "column weight grad")
        close(col.bias.grad, param_info(col.bias).tp_shard.local_from_full(ref.bias.grad), "column bias grad")

    ref = nn.Linear(4 * H, H)
    ref.weight.data, ref.bias.data = _inputs(5, H, 4 * H), _inputs(6, H)
    row = RowParallelLinear(4 * H, H, True, group, sp)
    row.weight.data = param_info(row.weight).tp_shard.local_from_full(ref.weight.data)
    row.bias.data = ref.bias.data.clone()
    x = _inputs(7, B, S, 4 * H).requires_grad_()
    x_local = x.detach().chunk(group.size, dim=-1)[group.rank].clone().requires_grad_()
    y_ref, y = ref(x), row(x_local)
    close(y, _shard_seq(y_ref.detach(), group, sp), f"row(sp={sp}) output")
    grad_out = _inputs(8, *y_ref.shape)
    y_ref.backward(grad_out)
    y.backward(_shard_seq(grad_out, group, sp))
    sum_sequence_parallel_grads(list(row.parameters()), plain_grads, group)
    close(x_local.grad, x.grad.chunk(group.size, dim=-1)[group.rank], "row input grad")
    close(row.weight.grad, param_info(row.weight).tp_shard.local_from_full(ref.weight.grad), "row weight grad")
    close(row.bias.grad, ref.bias.grad, "row bias grad (replicated)")


def check_column_keeps_the_sequence_shard(group):
    """Under sequence parallelism the column-parallel GEMM keeps only this rank's sequence shard for
    the backward (its weight gradient gathers it again), and a 16-bit weight marked for an fp32
    gradient gets the same fp32 sum, bit for bit, as the layer fed the whole sequence directly."""
    ref_w = _inputs(16, 4 * H, H).bfloat16()
    x = _inputs(17, B, S, H).bfloat16()
    grad_out = _inputs(18, B, S, 4 * H // group.size).bfloat16()
    pending = {}
    for sp in (False, True):
        col = ColumnParallelLinear(H, 4 * H, False, group, sp, dtype=torch.bfloat16)
        col.weight.data = param_info(col.weight).tp_shard.local_from_full(ref_w)
        set_param_info(col.weight, fp32_grad=True)
        x_in = _shard_seq(x, group, sp).requires_grad_()
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
            y = col(x_in)
        y.backward(grad_out)
        pending[sp] = param_info(col.weight).pending_fp32_grad
        if sp:
            assert (B, S // group.size, H) in saved and (B, S, H) not in saved, saved
    assert pending[True].dtype == torch.float32
    assert torch.equal(pending[True], pending[False]), "fp32 weight gradient differs under SP"


def _regroup(y, size, chunks):
    """Gathered column output with chunks>1 is rank-major; turn it into block-major (full) order."""
    per_rank = y.chunk(size, dim=-1)
    blocks = [torch.cat([r.chunk(chunks, dim=-1)[c] for r in per_rank], dim=-1) for c in range(chunks)]
    return torch.cat(blocks, dim=-1)


def check_embedding_and_loss(group, sp):
    vocab, padded = 50, 56  # 50 is not divisible by 4: rows 50..55 are padding
    word_ref = nn.Embedding(padded, H)
    word_ref.weight.data = torch.cat([_inputs(9, vocab, H), torch.zeros(padded - vocab, H)])
    pos_ref = nn.Embedding(S, H)
    pos_ref.weight.data = _inputs(10, S, H)
    word = VocabParallelEmbedding(padded, H, group)
    word.weight.data = param_info(word.weight).tp_shard.local_from_full(word_ref.weight.data)
    pos = nn.Embedding(S, H)
    pos.weight.data = pos_ref.weight.data.clone()
    emb = ParallelEmbedding(word, pos, nn.Identity(), group, sp)
    tokens = torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(11))
    labels = torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(12))

    x_ref = word_ref(tokens) + pos_ref(torch.arange(S))
    x = emb(tokens)
    close(x, _shard_seq(x_ref.detach(), group, sp), f"embedding(sp={sp}) output")

    norm_ref = nn.LayerNorm(H)
    norm_ref.weight.data, norm_ref.bias.data = _inputs(13, H), _inputs(14, H)
    norm = nn.LayerNorm(H)
    norm.load_state_dict(norm_ref.state_dict())
    norm = SequenceParallelNorm(norm, group) if sp else norm
    head = ParallelLMHead(word.weight, vocab, group, sp)  # tied to the embedding
    loss = head(norm(x), labels)
    logits_ref = F.linear(norm_ref(x_ref), word_ref.weight)[..., :vocab]
    loss_ref = F.cross_entropy(logits_ref.flatten(0, 1), labels.flatten(), reduction="none").view(B, S)
    close(loss, loss_ref, "vocab-parallel cross entropy")
    close(head(norm(x)), logits_ref, "gathered logits")
    weights = _inputs(15, B, S)
    (loss * weights).sum().backward()
    (loss_ref * weights).sum().backward()
    sum_sequence_parallel_grads(list(norm.parameters()), plain_grads, group)
    close(
        word.weight.grad, param_info(word.weight).tp_shard.local_from_full(word_ref.weight.grad), "tied embedding grad"
    )
    assert torch.all(word_ref.weight.grad[vocab:] == 0), "padding rows must get no gradient"
    close(pos.weight.grad, pos_ref.weight.grad, "position embedding grad")
    close(norm.weight.grad, norm_ref.weight.grad, "norm weight grad")
    close(norm.bias.grad, norm_ref.bias.grad, "norm bias grad")


def tp_layers_vs_reference(ctx, tp):
    groups = ctx.groups(Topology(world_size=tp, tp=tp))
    if groups is None:
        return None
    for sp in (False, True):
        check_column_row(groups.tp, sp)
        check_embedding_and_loss(groups.tp, sp)
    check_column_keeps_the_sequence_shard(groups.tp)
    return True


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_layers_match_single_device(dist_pool, tp):
    results = dist_pool(4).run(tp_layers_vs_reference, tp)
    assert results[:tp] == [True] * tp
