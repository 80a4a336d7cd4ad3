"""Megatron-LM's model flags (megazero/config/model_flags.py) with Megatron's meaning.

- Each flag that changes the math (--kv-channels other than hidden / heads, --rotary-percent 0.5,
  --apply-layernorm-1p) trains at tp 2 (with sequence parallelism) and at pp 2 on the one-process loss
  curve and parameters (fp32, rtol 1e-5, 10 steps), and matches an independent statement of its
  meaning: attention written out head by head in float64 with heads kv_channels wide; a zero-centred
  norm equals the plain norm holding weight + 1 (the rotary fraction's reference is in
  tests/models/test_attention.py).
- The flags map as Megatron maps them: --num-query-groups counts only with --group-query-attention
  (which defaults it to 1), --recompute-activations is selective recomputation, full recomputation
  takes a method and a layer count within a pipeline stage, --cross-entropy-loss-fusion and
  --attention-backend fused on CPU are accepted with a note; --cpu-offloading-num-layers N > 0 turns
  activation offload on by itself (Megatron's validate_args), counts within a model chunk, and
  --cpu-offloading alone offloads every layer.
Planted bugs: SequenceParallelNorm without the `+ 1` fails the layernorm-1p tp 2 layout; the
attention scale 1/sqrt(hidden / heads) instead of 1/sqrt(kv_channels) fails the written-out check.
"""

import math

import pytest
import torch

from tests.layouts import (
    assemble_params,
    assert_close,
    assert_params_match,
    last_stage_result,
    layout_worker,
    run_training,
    small_config,
    strip_padding,
)
from megazero.config.train_flags import config_from_args, parse_args
from megazero.core.errors import UsageError
from megazero.models.config import GPTConfig
from megazero.models.gpt import GPT, initial_value
from megazero.parallel.process_groups import ProcessGroups

VOCAB = 61
# Biases off where the attention changes shape: an attention bias element whose gradient is ~0 (a
# value-bias coordinate, softmax-invariant key-bias ones) moves by Adam-amplified reduction noise,
# which can exceed the per-tensor 1e-5 whatever the layout (tests/layouts.py, assert_params_match).
OPTIONS = {
    "--kv-channels 12": {"kv_channels": 12, "num_query_groups": 2, "add_bias_linear": False},
    "--rotary-percent 0.5": {"position_embedding": "rope", "rotary_percent": 0.5, "add_bias_linear": False},
    "--apply-layernorm-1p": {"apply_layernorm_1p": True},
}


def _layouts(extra):
    return [
        (small_config(tp=2, sequence_parallel=True, model_extra=extra), 1),
        (small_config(pp=2, model_extra=extra), 1),
    ]


def many_layouts(ctx, layouts):
    return [layout_worker(ctx, cfg, dp) for cfg, dp in layouts]


def test_each_flag_matches_one_process_at_tp2_and_pp2(dist_pool):
    layouts = [layout for extra in OPTIONS.values() for layout in _layouts(extra)]
    per_rank = dist_pool(2).run(many_layouts, layouts)
    results = [list(r) for r in zip(*per_rank)]
    for i, (flag, extra) in enumerate(OPTIONS.items()):
        ref = run_training(small_config(model_extra=extra), ProcessGroups.single())
        ref_params = strip_padding(assemble_params([ref]), VOCAB)
        for layout, got in zip(("tp 2 + sequence parallel", "pp 2"), results[2 * i : 2 * i + 2]):
            assert_close(last_stage_result(got)["losses"], ref["losses"], f"{flag} {layout}: losses")
            assert_params_match(strip_padding(assemble_params(got), VOCAB), ref_params, f"{flag} {layout}")


def _model(cfg: GPTConfig, seed=0) -> GPT:
    model = GPT(cfg)
    generator = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        p.data = initial_value(cfg, name, p.shape, 5) + 0.05 * torch.randn(p.shape, generator=generator)
    return model


def test_kv_channels_heads_are_written_out_attention_of_that_width():
    cfg = GPTConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=6,
        seq_length=7,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    attention = _model(cfg).layers["0"].attention
    assert attention.qkv.weight.shape == (2 * (2 + 2) * 6, 16) and attention.proj.weight.shape == (16, 24)
    x = torch.randn(1, 7, 16)
    w, b = attention.qkv.weight.double(), attention.qkv.bias.double()
    rows = (x.double() @ w.T + b).view(7, 2, 4, 6)  # per group: q, q, k, v
    heads = []
    for h in range(4):
        g, r = divmod(h, 2)
        q, k, v = rows[:, g, r], rows[:, g, 2], rows[:, g, 3]
        scores = q @ k.T / math.sqrt(6) + torch.full((7, 7), float("-inf"), dtype=torch.double).triu(1)
        heads.append(scores.softmax(-1) @ v)
    expected = torch.cat(heads, -1) @ attention.proj.weight.double().T + attention.proj.bias.double()
    with torch.no_grad():
        got = attention(x)[0]
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)


def test_layernorm_1p_is_the_plain_norm_with_weight_plus_one():
    for normalization in ("layernorm", "rmsnorm"):
        fields = dict(
            vocab_size=VOCAB,
            hidden_size=16,
            num_layers=2,
            num_attention_heads=2,
            seq_length=8,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            normalization=normalization,
        )
        one_p, plain = _model(GPTConfig(**fields, apply_layernorm_1p=True)), GPT(GPTConfig(**fields))
        state = {n: (v + 1 if "norm.weight" in n else v) for n, v in one_p.state_dict().items()}
        plain.load_state_dict(state)
        tokens = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
        losses = [m(tokens[:, :-1], tokens[:, 1:]).sum() for m in (one_p, plain)]
        assert torch.equal(losses[0], losses[1]), normalization
        for loss in losses:
            loss.backward()
        for (name, a), b in zip(one_p.named_parameters(), plain.parameters()):
            assert torch.equal(a.grad, b.grad), f"{normalization}: {name}"


def _model_config(*flags):
    cfg = config_from_args(parse_args(list(flags)), world_size=2)
    return cfg.model, cfg.notes


def test_query_groups_take_megatrons_meaning():
    assert _model_config("--group-query-attention", "--num-query-groups", "2")[0].num_query_groups == 2
    assert _model_config("--group-query-attention")[0].num_query_groups == 1  # Megatron's default: 1
    model, notes = _model_config("--num-query-groups", "2")
    assert model.num_query_groups == model.num_attention_heads
    assert notes == [
        "--num-query-groups 2 has no effect without --group-query-attention (Megatron-LM's "
        "meaning): every head has its own key and value; add --group-query-attention for "
        "grouped-query attention"
    ]


def test_cpu_offloading_flags_take_megatrons_meaning():
    offloaded = lambda *flags: (
        config_from_args(
            parse_args(["--num-layers", "4", *flags]),
            world_size=2,  # noqa: E731
        ).parallel.cpu_offloading_num_layers
    )
    assert offloaded() == offloaded("--cpu-offloading-num-layers", "0") == 0
    assert offloaded("--cpu-offloading-num-layers", "3") == 3 and offloaded("--cpu-offloading") == 4
    assert offloaded("--cpu-offloading", "--pipeline-model-parallel-size", "2") == 2
    # the zero-bubble schedules too: a deferred W keeps the fetched copies of the inputs it reads
    assert (
        offloaded(
            "--cpu-offloading-num-layers",
            "1",
            "--pipeline-model-parallel-size",
            "2",
            "--pipeline-schedule",
            "zb-h1",
            "--global-batch-size",
            "8",
        )
        == 1
    )


def test_recompute_flags_take_megatrons_meaning():
    model, _ = _model_config("--recompute-activations")
    assert (model.recompute_granularity, model.recompute_method) == ("selective", None)
    model, _ = _model_config(
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "block",
        "--recompute-num-layers",
        "2",
        "--pipeline-model-parallel-size",
        "2",
    )
    assert (model.recompute_granularity, model.recompute_method, model.recompute_num_layers) == ("full", "block", 2)


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--recompute-granularity", "full"], "--recompute-granularity full needs --recompute-method uniform|block"),
        (
            ["--recompute-granularity", "full", "--recompute-method", "uniform"],
            "--recompute-granularity full needs --recompute-num-layers N >= 1",
        ),
        (
            ["--recompute-method", "block", "--recompute-num-layers", "1"],
            "--recompute-method block needs --recompute-granularity full",
        ),
        (["--recompute-activations", "--recompute-granularity", "full"], "--recompute-activations is selective"),
        (
            [
                "--recompute-granularity",
                "full",
                "--recompute-method",
                "block",
                "--recompute-num-layers",
                "3",
                "--pipeline-model-parallel-size",
                "2",
            ],
            "--recompute-num-layers 3 is more than the 2 layers of a pipeline",
        ),
        (["--cpu-offloading-num-layers", "-1"], "--cpu-offloading-num-layers must be >= 0"),
        (
            ["--cpu-offloading", "--cpu-offloading-num-layers", "0"],
            "--cpu-offloading with --cpu-offloading-num-layers 0 offloads nothing",
        ),
        (
            [
                "--cpu-offloading",
                "--cpu-offloading-num-layers",
                "3",
                "--num-layers",
                "4",
                "--pipeline-model-parallel-size",
                "2",
            ],
            "--cpu-offloading-num-layers 3 is more than the 2 layers of a pipeline stage's model chunk",
        ),
        (["--kv-channels", "0"], "--kv-channels must be >= 1"),
        (["--rotary-percent", "0.5"], "--rotary-percent 0.5 needs --position-embedding-type rope"),
        (["--rotary-percent", "1.5"], "--rotary-percent must be in (0, 1]"),
        (
            ["--position-embedding-type", "rope", "--kv-channels", "6", "--rotary-percent", "0.5"],
            "head size 6 x --rotary-percent 0.5 = 3 dims must be even",
        ),
        (["--compile-backend", "eager"], "--compile-backend eager needs --compile"),
    ],
)
def test_bad_model_flags_are_one_line(flags, message):
    with pytest.raises(UsageError, match=message.replace("|", r"\|").replace("(", r"\(").replace(")", r"\)")):
        config_from_args(parse_args(flags), world_size=2)


def test_accepted_flags_say_what_they_mean():
    model, notes = _model_config(
        "--cross-entropy-loss-fusion",
        "--attention-backend",
        "fused",
        "--kv-channels",
        "32",
        "--apply-layernorm-1p",
        "--position-embedding-type",
        "rope",
        "--rotary-percent",
        "0.25",
        "--distributed-backend",
        "gloo",
    )
    assert (model.kv_channels, model.rotary_dim, model.apply_layernorm_1p, model.attention_backend) == (
        32,
        8,
        True,
        "fused",
    )
    assert any(
        n.startswith(
            "--cross-entropy-loss-fusion has no effect: the output layer and the cross entropy always run fused"
        )
        for n in notes
    )
    assert any(n.startswith("--attention-backend fused: cuDNN and memory-efficient attention are CUDA") for n in notes)


def test_flash_attention_in_fp32_on_cuda_is_refused_before_the_run():
    from megazero.config.model_flags import check_attention_precision

    model = GPTConfig(vocab_size=VOCAB, attention_backend="flash")
    with pytest.raises(UsageError, match="--attention-backend flash runs in bf16 or fp16 on CUDA"):
        check_attention_precision(model, half_precision=False, cuda=True)
    check_attention_precision(model, half_precision=True, cuda=True)
    check_attention_precision(model, half_precision=False, cuda=False)  # the CPU flash kernel takes fp32
