"""TiledLinear against the untiled layer: forward and gradients within the fp32 summation bound, the
layout-independent init, and ZeRO stage 3 with tiled MLP layers and output head (same training run,
smaller peak of gathered parameters)."""

import pytest
import torch
from torch import nn

from tests.layouts import assert_close, assert_params_match, run_training, small_config
from megazero.training import assembly
from megazero.core.errors import UsageError
from megazero.training.model_builder import make_init_fn
from megazero.models.config import GPTConfig
from megazero.models.gpt import GPT
from megazero.parallel.tiling import TiledLinear, check_patterns_matched, tile_linears
from megazero.parallel.topology import Topology

EPS32 = 2.0**-24


def _bound(x, w):
    """2 n eps sum_k |x_k w_jk|: two fp32 sums of n products, each within n eps of the exact one."""
    return 2 * x.shape[-1] * EPS32 * (x.abs() @ w.abs().T)


@pytest.mark.parametrize("in_splits,out_splits", [(1, 1), (3, 1), (1, 4), (3, 4), (7, 5)])
def test_forward_and_grads_match_untiled(in_splits, out_splits):
    torch.manual_seed(0)
    linear = nn.Linear(37, 29)
    tiled = TiledLinear.from_linear(linear, in_splits, out_splits)
    tiled.mark_sources("w", "b")
    tiled.copy_from(linear.weight, linear.bias)
    x = torch.randn(3, 5, 37)
    x_ref, x_tiled = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, y = linear(x_ref), tiled(x_tiled)
    assert y.shape == y_ref.shape
    assert bool(((y - y_ref).abs() <= _bound(x, linear.weight.detach()) + 1e-30).all())
    dy = torch.randn_like(y)
    y_ref.backward(dy)
    y.backward(dy)
    # dW = dy^T x sums over the 15 tokens, dx = dy W over the output features: same bound shape.
    dw = tiled.full_weight([t.weight.grad for t in tiled.tiles])
    dw_bound = 2 * 15 * EPS32 * (dy.abs().flatten(0, 1).T @ x.abs().flatten(0, 1))
    assert bool(((dw - linear.weight.grad).abs() <= dw_bound).all())
    db = torch.cat([tiled.tile(o, 0).bias.grad for o in range(out_splits)])
    torch.testing.assert_close(db, linear.bias.grad, rtol=15 * EPS32 * 2, atol=1e-7)
    dx_bound = 2 * 29 * EPS32 * (dy.abs() @ linear.weight.detach().abs())
    assert bool(((x_tiled.grad - x_ref.grad).abs() <= dx_bound + 1e-30).all())


def _tiny_model(tied: bool) -> GPT:
    cfg = GPTConfig(
        vocab_size=50,
        padded_vocab_size=56,
        hidden_size=16,
        num_layers=2,
        num_attention_heads=2,
        ffn_hidden_size=40,
        seq_length=8,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tie_embeddings=tied,
    )
    with torch.device("meta"):
        return GPT(cfg)


def _materialise(model: GPT, seed=5) -> GPT:
    init = make_init_fn(model.config, seed)
    values = {name: init(name, p) for name, p in model.named_parameters()}  # to_empty drops attributes
    model.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(values[name])
    return model


def test_tiled_model_starts_from_untiled_weights_and_computes_the_same_loss():
    plain = _materialise(_tiny_model(tied=False))
    tiled = _tiny_model(tied=False)
    swapped = tile_linears(tiled, ["output_head", "layers.*.mlp.fc1", "layers.1.mlp.fc2"], 3, 2)
    assert swapped == ["layers.0.mlp.fc1", "layers.1.mlp.fc1", "layers.1.mlp.fc2", "output_head"]
    _materialise(tiled)
    for name in ("layers.0.mlp.fc1", "layers.1.mlp.fc2"):
        torch.testing.assert_close(
            tiled.get_submodule(name).full_weight(), plain.get_submodule(name).weight, rtol=0, atol=0
        )
    torch.testing.assert_close(tiled.output_head.linear.full_weight(), plain.output_head.weight, rtol=0, atol=0)
    tokens = torch.randint(0, 50, (2, 9))
    loss_plain = plain(tokens[:, :-1], tokens[:, 1:]).mean()
    loss_tiled = tiled(tokens[:, :-1], tokens[:, 1:]).mean()
    torch.testing.assert_close(loss_tiled, loss_plain, rtol=1e-6, atol=0)


def test_bad_tiling_requests_are_one_line_errors():
    with pytest.raises(UsageError, match="tied word embedding"):
        tile_linears(_tiny_model(tied=True), ["output_head"], 2, 2)
    with pytest.raises(UsageError, match="only plain nn.Linear"):
        tile_linears(_tiny_model(tied=False), ["layers.0.mlp"], 2, 2)
    with pytest.raises(UsageError, match="input splits"):
        tile_linears(_tiny_model(tied=False), ["layers.0.mlp.fc2"], 41, 1)
    with pytest.raises(UsageError, match="matches no module"):
        check_patterns_matched(["layers.*.mlp.fc3"], [[]])


# --- ZeRO stage 3 on 2 ranks ---------------------------------------------------------------------

TILED = ["layers.*.mlp.fc1", "layers.*.mlp.fc2", "output_head"]
SPLITS = 2  # 2 x 2 tiles: each tile a quarter of its layer


def _stage3_config(steps: int):
    # The MLP weights dominate (hidden 32 x ffn 512), so they set the peak of gathered parameters;
    # no prefetch and release right after use (FSDP's profile) make the peak one unit's worth.
    return small_config(
        stage=3,
        steps=steps,
        micro=2,
        global_batch=8,
        layers=2,
        tied=False,
        model_extra={"ffn_hidden_size": 512},
        zero_extra={"max_reuse_distance": 0, "prefetch_bucket_size": 0},
    )


def tiled_training_worker(ctx, tiled: bool, steps: int):
    groups = ctx.groups(Topology(world_size=2))
    original = assembly.build_model_chunks

    def build_tiled(*args, **kwargs):
        chunks = original(*args, **kwargs)
        for chunk in chunks:
            tile_linears(chunk, TILED, SPLITS, SPLITS)
        return chunks

    # setup() has no tiling option yet; swap the builder for this call only.
    assembly.build_model_chunks = build_tiled if tiled else original
    try:
        result = run_training(_stage3_config(steps), groups)
    finally:
        assembly.build_model_chunks = original
    if tiled:
        result["params"] = _untile(result["params"])
    return result


def _untile(params: dict) -> dict:
    """Reassembles `<layer>.tiles.<k>.weight|bias` into the untiled `<layer>.weight|bias`."""
    out, tiles = {}, {}
    for name, (value, shard) in params.items():
        name = name.replace("output_head.linear.", "output_head.")  # TiledLMHead's projection
        if ".tiles." not in name:
            out[name] = value
            continue
        layer, rest = name.split(".tiles.")
        index, kind = rest.split(".")
        tiles.setdefault((layer, kind), {})[int(index)] = value
    for (layer, kind), by_index in tiles.items():
        values = [by_index[k] for k in sorted(by_index)]
        if kind == "bias":  # only the first input block carries one: ordered by output block
            out[f"{layer}.bias"] = torch.cat(values)
        else:
            rows = [torch.cat(values[o * SPLITS : (o + 1) * SPLITS], dim=1) for o in range(SPLITS)]
            out[f"{layer}.weight"] = torch.cat(rows)
    return out


def test_zero3_tiled_run_matches_untiled_and_gathers_less(dist_pool):
    plain = dist_pool(2).run(tiled_training_worker, False, 4)
    tiled = dist_pool(2).run(tiled_training_worker, True, 4)
    assert_close(tiled[0]["losses"], plain[0]["losses"], "tiled vs untiled losses")
    # the one rule for parameters (tests/layouts.py): per tensor, the key bias's rounding noise left out
    assert_params_match(
        tiled[0]["params"],
        {name: value for name, (value, _) in plain[0]["params"].items()},
        "tiled vs untiled parameters",
    )
    peak_plain = plain[0]["memory"]["peak_live_params"]
    peak_tiled = tiled[0]["memory"]["peak_live_params"]
    # The peak is the largest unit (fc1: 512 x 32 weight + 512 bias; tiled, its largest tile is
    # 256 x 16 + 256) plus whatever else is gathered at that moment, which tiling does not change.
    fc1, fc1_tile = 512 * 32 + 512, 256 * 16 + 256
    assert peak_plain - 4 * fc1 == peak_tiled - 4 * fc1_tile, (
        f"peak gathered bytes {peak_plain} untiled, {peak_tiled} tiled"
    )
    assert peak_tiled * 2.5 <= peak_plain  # ~3x overall; 3.9x for the layer itself
