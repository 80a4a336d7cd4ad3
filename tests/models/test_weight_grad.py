"""Gradient-accumulation fusion (models/weight_grad.py): 16-bit weights get their gradients summed in fp32.

- Each layer function against the torch op it replaces, on bf16 tensors: the forward output and the
  input gradient are bitwise torch's; the weight (and bias) gradient the layer deposits equals the
  float64 sum torch computes from the same bf16 tensors (1e-6), where autograd's bf16 gradient is off
  by bf16's rounding (asserted > 1e-4, so the comparison can tell them apart). Split over two halves
  of the tokens, the deposits add up to the whole batch's (1e-6); autograd's two bf16 halves do not.
- A tied table (embedding lookup and output layer on one weight): the taken gradient is both uses'.
- Unmarked, fp32 or no-grad calls take torch's own path (nothing deposited).
- The engine at stages 0-3, one process, bf16: eight microbatches of one sample accumulate the
  fused parameters' gradients of one microbatch of eight to 1e-6 (with
  --no-gradient-accumulation-fusion autograd's per-microbatch rounding moves them by > 1e-4).

Planted: `take_grad` dropping the 16-bit `.grad` (a tied weight's other use) fails the tied check;
the engine not marking its stage-3 parameters fails stage 3's gap; `_Linear.backward` depositing
the bias gradient rounded to bf16 fails the bias comparison.
"""

import pytest
import torch
import torch.nn.functional as F

from tests.layouts import ProcessGroups, setup_training, small_config, with_padded_vocab
from megazero.models.loss import linear_cross_entropy
from megazero.models.weight_grad import add_bias, embedding, linear
from megazero.zero.precision import take_grad
from megazero.models.param_info import param_info, set_param_info

BF16 = torch.bfloat16


def _param(*shape, seed):
    gen = torch.Generator().manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(*shape, generator=gen).to(BF16))
    set_param_info(p, fp32_grad=True)
    return p


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _cases():
    """name -> (fn(input, *params), input, params, fp64 gradient of each param given dout)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 64, 32, generator=gen).to(BF16)
    ids = torch.randint(0, 50, (4, 64), generator=gen)
    labels = torch.randint(0, 50, (4, 64), generator=gen)
    return {
        "linear": (
            lambda t, w, b: linear(t, w, b),
            x,
            (_param(48, 32, seed=1), _param(48, seed=2)),
            lambda t, dout: [dout.double().flatten(0, 1).t() @ t.double().flatten(0, 1), dout.double().sum(dim=(0, 1))],
        ),
        "bias": (
            lambda t, b: add_bias(t, b),
            x,
            (_param(32, seed=3),),
            lambda t, dout: [dout.double().sum(dim=(0, 1))],
        ),
        "embedding": (
            lambda t, w: embedding(t, w),
            ids,
            (_param(50, 32, seed=4),),
            lambda t, dout: [
                torch.zeros(50, 32, dtype=torch.float64).index_add_(0, t.flatten(), dout.double().flatten(0, 1))
            ],
        ),
    }, (x, labels)


def _plain(name):
    return {
        "linear": lambda t, w, b: F.linear(t, w, b),
        "bias": lambda t, b: t + b,
        "embedding": lambda t, w: F.embedding(t, w),
    }[name]


@pytest.mark.parametrize("name", ["linear", "bias", "embedding"])
def test_layers_match_torch_and_sum_weight_gradients_in_fp32(name):
    cases, _ = _cases()
    fn, inp, params, exact_grads = cases[name]
    inp = inp.clone().requires_grad_(inp.is_floating_point())
    out = fn(inp, *params)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).to(BF16)
    out.backward(dout)
    deposited = [take_grad(p) for p in params]
    plain_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    plain_inp = inp.detach().clone().requires_grad_(inp.is_floating_point())
    plain_out = _plain(name)(plain_inp, *plain_params)
    plain_out.backward(dout)
    assert torch.equal(out, plain_out), name
    if inp.is_floating_point():
        assert torch.equal(inp.grad, plain_inp.grad), f"{name}: input gradient"
    for p, got, plain, exact in zip(params, deposited, plain_params, exact_grads(inp.detach(), dout)):
        assert got.dtype == torch.float32 and p.grad is None and param_info(p).pending_fp32_grad is None
        assert _rel(got, exact) <= 1e-6, f"{name}: fp32 weight gradient off by {_rel(got, exact):.1e}"
        assert _rel(plain.grad, exact) > 1e-4, f"{name}: bf16 gradient too close to tell apart"
    # Two halves of the tokens, one backward each: the deposits add up to the whole batch's.
    halves = [inp.detach()[:, :32], inp.detach()[:, 32:]]
    for half, dhalf in zip(halves, (dout[:, :32], dout[:, 32:])):
        fn(half, *params).backward(dhalf)
    summed = [take_grad(p) for p in params]
    for got, whole in zip(summed, deposited):
        assert _rel(got, whole) <= 1e-6, f"{name}: halves {_rel(got, whole):.1e} off the whole batch"


def test_tied_table_gets_both_uses_and_unmarked_calls_take_torchs_path():
    """The table's lookup (fused) with the fused output layer and loss, then with a plain
    F.linear head (LMHead's logits path), whose bf16 gradient autograd puts in .grad."""
    _, (x, labels) = _cases()
    table = _param(56, 32, seed=5)  # 50 real words, padded to 56
    ids = labels.roll(1, dims=1)
    heads = {
        "fused": lambda h: linear_cross_entropy(h, table, labels, 50).float().sum(),
        "plain": lambda h: F.cross_entropy(
            F.linear(h, table)[..., :50].float().flatten(0, 1), labels.flatten(), reduction="sum"
        ),
    }
    for kind, head_loss in heads.items():
        hidden = embedding(ids, table) + x
        hidden.retain_grad()
        head_loss(hidden).backward()
        assert table.grad is not None and (table.grad.any() == (kind == "plain")), kind
        both = take_grad(table)
        # Each use alone, fed what it was fed in the joint backward.
        embedding(ids, table).backward(hidden.grad)
        lookup = take_grad(table)
        head_loss(hidden.detach()).backward()
        head = take_grad(table)
        assert _rel(both, lookup + head) <= 1e-6, kind
        assert _rel(lookup, both) > 0.1 and _rel(head, both) > 0.1, kind
    # Unmarked, fp32 and no-grad calls: torch's path, nothing deposited.
    unmarked = torch.nn.Parameter(table.detach().clone())
    embedding(ids, unmarked).float().sum().backward()
    assert unmarked.grad is not None and unmarked.grad.any() and param_info(unmarked).pending_fp32_grad is None
    with torch.no_grad():
        linear(x, table)
    assert param_info(table).pending_fp32_grad is None
    fp32 = torch.nn.Parameter(torch.ones(8, 32))
    set_param_info(fp32, fp32_grad=True)
    linear(x.float(), fp32).sum().backward()
    assert fp32.grad is not None and param_info(fp32).pending_fp32_grad is None


FUSED = ("qkv.", "proj.", "fc1.", "fc2.", "embedding.word.")  # linear layers and the (tied) table


def _accumulated_grads(stage: int, micro: int, fusion: bool) -> dict[str, torch.Tensor]:
    """The engine's fp32 gradients of the fused parameters after one step's backward of 8 samples."""
    from megazero.zero.state_access import safe_get_full_grad

    cfg = with_padded_vocab(small_config(bf16=True, stage=stage, micro=micro, global_batch=8, layers=2))
    cfg.precision.gradient_accumulation_fusion = fusion
    state, source = setup_training(cfg, ProcessGroups.single())
    engine, model = state.engine, state.chunks[0]
    batches = source.batch(0)
    engine.begin_step()
    for k, tokens in enumerate(batches):
        loss = model(tokens[:, :-1], tokens[:, 1:]).float().mean() / len(batches)
        engine.backward(loss, last_microbatch=k == len(batches) - 1)
    engine.finish_gradients()
    return {n: safe_get_full_grad(p).double() for n, p in model.named_parameters() if any(part in n for part in FUSED)}


def _worst_gap(a: dict, b: dict) -> float:
    return max(_rel(a[n], b[n]) for n in a)


def test_engine_takes_fp32_weight_gradients_at_every_stage():
    """Eight microbatches of one sample against one of eight: the same fp32 sums, so the linear
    layers' and the table's accumulated gradients agree to fp32 noise at stages 0-3 (the norms'
    weights and the learned position table, summed over the batch by autograd, stay bf16)."""
    gaps = {
        stage: _worst_gap(_accumulated_grads(stage, 1, True), _accumulated_grads(stage, 8, True))
        for stage in (0, 1, 2, 3)
    }
    unfused = _worst_gap(_accumulated_grads(3, 1, False), _accumulated_grads(3, 8, False))
    print(
        "8 x 1 vs 1 x 8 samples, worst relative gap of a fused parameter's gradient:", gaps, "unfused stage 3:", unfused
    )
    assert all(gap <= 1e-6 for gap in gaps.values()), gaps
    assert unfused > 1e-4, unfused


def test_the_flag_turns_it_off_and_fp32_runs_never_mark():
    from megazero.config.train_flags import config_from_args, parse_args
    from megazero.zero.precision import Precision

    on = config_from_args(parse_args(["--bf16"]))
    off = config_from_args(parse_args(["--bf16", "--no-gradient-accumulation-fusion"]))
    assert (
        Precision.from_config(on.precision).fp32_weight_grads
        and not Precision.from_config(off.precision).fp32_weight_grads
    )
    assert not Precision.from_config(config_from_args(parse_args([])).precision).fp32_weight_grads  # fp32 weights
    bf16_accum = config_from_args(parse_args(["--bf16"]))
    bf16_accum.precision.grad_accum_dtype = "bf16"  # autograd accumulates into the buffer itself
    assert not Precision.from_config(bf16_accum.precision).fp32_weight_grads
