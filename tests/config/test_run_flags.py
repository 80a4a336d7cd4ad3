"""Megatron-LM's run flags (megazero/config/run_flags.py): a user's launch script runs unedited.

- Megatron-LM's own recipes, Llama-3 8B (bf16, mock data) and GPT-3 175B (fp16, GPT-2 BPE files
  without --tokenizer-type, --rampup-batch-size), are held below as a user's script writes them,
  scaled to a tiny model, and train at 1 rank (in-process) and at 2 ranks (tp 2 + sequence parallel,
  pp 2) with every flag as given; the 2-rank Llama run's --profile trace holds exactly the chosen
  steps, on rank 0 only (its --profile-ranks default), and loads as JSON.
- --decoupled-lr and the per-token loss normalisation (--calculate-per-token-loss, over a batch
  ramp whose global batch changes every step) match one process at tp 2, pp 2 (and dp 2 with ZeRO-1
  for the decoupled rates) in fp32 at 1e-5, and the one-process run matches torch's AdamW with two
  parameter groups on the sum of token cross entropies over the global batch's token count.
- --rampup-batch-size's batches per iteration and iteration count equal Megatron's calculator
  (restated below from its RampupBatchsizeNumMicroBatchesCalculator and update_train_iters), and a
  run resumed mid-ramp from a checkpoint continues bit for bit.
Planted bugs, each failing here: the engine ignoring the lr group (every parameter at `lr`); the loss
normalised by --global-batch-size instead of the step's batch; the ramp's step count rounded up
instead of truncated; a resumed run restarting its consumed samples at iteration x global batch.
"""

import json
import math
import uuid

import numpy as np
import pytest
import torch

from tests.metrics_reading import split_records
from tests.layouts import (
    assemble_params,
    assert_close,
    assert_params_match,
    last_stage_result,
    layout_worker,
    microbatches,
    run_training,
    small_config,
    strip_padding,
)
from megazero.run import launch
from megazero.config.train_flags import config_from_args, parse_args
from megazero.config.batch_ramp import BatchRamp
from megazero.config.flags import megatron_flags_megazero_lacks
from megazero.core.errors import UsageError
from megazero.parallel.process_groups import ProcessGroups
from megazero.parallel.topology import Topology

VOCAB = 61

# Megatron-LM's examples/llama/train_llama3_8b_h100_fp8.sh (bf16, mock data), sizes scaled down.
LLAMA3 = """
--use-mcore-models --num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4
--group-query-attention --num-query-groups 2 --kv-channels 16 --seq-length 32 --max-position-embeddings 32
--position-embedding-type rope --rotary-base 1000000 --rotary-percent 1.0 --attention-dropout 0.0
--hidden-dropout 0.0 --swiglu --normalization RMSNorm --init-method-std 0.0134 --attention-backend fused
--apply-layernorm-1p --untie-embeddings-and-output-weights --disable-bias-linear
--micro-batch-size 1 --global-batch-size 4 --train-samples 16 --lr-decay-samples 15 --lr-warmup-samples 4
--lr 0.00015 --min-lr 0.00001 --decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5 --lr-decay-style cosine
--clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16 --grad-reduce-in-bf16
--cross-entropy-loss-fusion --calculate-per-token-loss --manual-gc --empty-unused-memory-level 1
--exit-duration-in-mins 235
--tensor-model-parallel-size {tp} --context-parallel-size 1 --sequence-parallel
--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
--mock-data --tokenizer-type NullTokenizer --vocab-size 512 --data-cache-path {dir}/cache --tiktoken-pattern v2
--split 99,1,0 --no-create-attention-mask-in-dataloader --no-mmap-bin-files --num-workers 1
--log-interval 1 --eval-iters 1 --eval-interval 100 --save-interval 1000 --log-throughput --profile
--profile-step-start 1 --profile-step-end 3 --ckpt-format torch_dist --distributed-timeout-minutes 60
--save {dir}/ckpt --load {dir}/ckpt --tensorboard-dir {dir}/tb
"""

# Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh (the version with --rampup-batch-size),
# sizes scaled down.
GPT3 = """
--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32
--attention-backend auto
--micro-batch-size 1 --global-batch-size 8 --rampup-batch-size 2 2 8 --train-iters 4 --weight-decay 0.1
--adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.006 --clip-grad 1.0 --fp16 --lr 6.0e-5
--lr-decay-style cosine --min-lr 6.0e-6 --lr-warmup-fraction .001 --lr-decay-iters 3
--tensor-model-parallel-size 1 --pipeline-model-parallel-size {pp}
--data-path {data} --vocab-file {vocab} --merge-file {merges} --split 949,50,1
--log-interval 100 --save-interval 10000 --eval-interval 1000 --save {dir}/ckpt --load {dir}/ckpt
--eval-iters 1 --tensorboard-dir {dir}/tb
"""


def recipe_argv(text: str, **values) -> list[str]:
    """The recipe as its script writes it: every flag kept (none of them is Megatron-only here)."""
    argv = text.format(**values).split()
    lacking = megatron_flags_megazero_lacks() & set(argv)
    assert not lacking, sorted(lacking)
    return argv


@pytest.fixture(scope="module")
def gpt2_data(tmp_path_factory):
    """GPT-2 BPE vocab.json / merges.txt trained here, and a .bin/.idx of text tokenized with them."""
    import tokenizers

    from megazero.data.indexed_dataset import IndexedDatasetBuilder
    from megazero.data.tokenizer import build_tokenizer

    folder = tmp_path_factory.mktemp("gpt3")
    lines = [f"def f{i}(x):\n    return x * {i} + {i * i}\n" for i in range(200)]
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        lines, vocab_size=300, min_frequency=2, special_tokens=["<|endoftext|>"], show_progress=False
    )
    vocab, merges = bpe.save_model(str(folder))
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    builder = IndexedDatasetBuilder(folder / "text_document", np.uint16)
    for line in lines:
        builder.add_item(np.array(tok.encode(line) + [tok.eod]))
        builder.end_document()
    builder.finalize()
    return dict(data=folder / "text_document", vocab=vocab, merges=merges)


# --- the recipes ------------------------------------------------------------------------------------
def test_recipes_train_unedited_on_one_rank(tmp_path, gpt2_data, capsys):
    llama = recipe_argv(LLAMA3, tp=1, dir=tmp_path / "llama") + ["--run-dir", str(tmp_path / "llama")]
    assert launch.main(llama) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "note: --use-mcore-models has no effect" in out and "note: --ckpt-format torch_dist" in out
    assert "note: --tiktoken-pattern v2 has no effect" in out
    train = split_records(tmp_path / "llama")
    assert [r["iteration"] for r in train] == [1, 2, 3, 4] and all(math.isfinite(r["loss"]) for r in train)
    assert all(r["decoupled_lr"] > r["lr"] for r in train[1:])
    assert (tmp_path / "llama" / "profile" / "rank0.pt.trace.json").is_file()

    gpt3 = recipe_argv(GPT3, pp=1, dir=tmp_path / "gpt3", **gpt2_data) + ["--run-dir", str(tmp_path / "gpt3")]
    cfg = config_from_args(parse_args(gpt3))
    assert cfg.data.tokenizer_type == "GPT2BPETokenizer" and cfg.rampup == BatchRamp(
        start=2, increment=2, samples=8, global_batch=8
    )
    assert launch.main(gpt3) == 0, capsys.readouterr().err
    assert "--rampup-batch-size with --train-iters" in capsys.readouterr().out
    train = split_records(tmp_path / "gpt3")
    assert train[0]["iteration"] == 1 and math.isfinite(train[0]["loss"]) and train[0]["global_batch_size"] == 2
    assert (tmp_path / "gpt3" / "ckpt" / "latest").read_text().strip() == "iter_0000004"


def _train_recipe(ctx, argv: list[str], store_prefix: str):
    """The recipe on the pool's process group: megazero.run.pretrain's checks, then its run."""
    from megazero.run import pretrain
    import torch.distributed as dist

    me = launch.Launch()
    me.rendezvous_store = dist.distributed_c10d._get_default_store()
    me.store = dist.PrefixStore(store_prefix, me.rendezvous_store)
    try:
        configured = pretrain.configure(argv, me)
    finally:
        torch.set_num_threads(1)
    par = configured.cfg.parallel
    groups = ctx.groups(
        Topology(
            world_size=2,
            tp=par.tensor_parallel,
            pp=par.pipeline_parallel,
            mics_shard_size=configured.cfg.zero.mics_shard_size,
        )
    )
    pretrain.Pretraining(configured, me).run(groups)
    return groups.coords


def test_recipes_train_unedited_on_two_ranks(dist_pool, tmp_path, gpt2_data):
    """Llama-3 at tp 2 with sequence parallelism, GPT-3 at pp 2; the Llama run's profile trace."""
    pool = dist_pool(2)
    llama = recipe_argv(LLAMA3, tp=2, dir=tmp_path / "llama") + ["--run-dir", str(tmp_path / "llama")]
    pool.run(_train_recipe, llama, f"llama-{uuid.uuid4().hex}")
    train = split_records(tmp_path / "llama")
    assert [r["iteration"] for r in train] == [1, 2, 3, 4] and all(math.isfinite(r["loss"]) for r in train)
    traces = sorted(p.name for p in (tmp_path / "llama" / "profile").iterdir())
    assert traces == ["rank0.pt.trace.json"]  # --profile-ranks defaults to rank 0
    trace = json.loads((tmp_path / "llama" / "profile" / "rank0.pt.trace.json").read_text())
    steps = {e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("megazero iteration")}
    assert steps == {"megazero iteration 2", "megazero iteration 3"}  # steps [1, 3) = iterations 2, 3

    gpt3 = recipe_argv(GPT3, pp=2, dir=tmp_path / "gpt3", **gpt2_data) + ["--run-dir", str(tmp_path / "gpt3")]
    pool.run(_train_recipe, gpt3, f"gpt3-{uuid.uuid4().hex}")
    assert math.isfinite(split_records(tmp_path / "gpt3")[0]["loss"])
    assert (tmp_path / "gpt3" / "ckpt" / "latest").read_text().strip() == "iter_0000004"


# --- exactness ---------------------------------------------------------------------------------------
def _decoupled(cfg):
    cfg.optimizer.decoupled_lr, cfg.optimizer.decoupled_min_lr = 4e-3, 3e-4
    return cfg


def _ramped(cfg):
    """Global batches 4, 4, 8, 12, 16, 16 (the normaliser changes every step); schedule in samples."""
    cfg.rampup = BatchRamp(start=4, increment=4, samples=24, global_batch=cfg.global_batch_size)
    opt = cfg.optimizer
    opt.in_samples, opt.warmup_iters, opt.decay_iters = True, 8, cfg.consumed_before(cfg.train_iters)
    return cfg


FLAGS = {
    "--decoupled-lr": (_decoupled, [(2, 1, 1, 0), (1, 2, 1, 0), (1, 1, 2, 1)]),
    "--calculate-per-token-loss over a ramp": (_ramped, [(2, 1, 1, 0), (1, 2, 1, 0)]),
}


def _config(flag, tp=1, pp=1, stage=0):
    return FLAGS[flag][0](small_config(tp=tp, pp=pp, stage=stage, steps=6, sequence_parallel=tp > 1))


def many_layouts(ctx, layouts):
    return [layout_worker(ctx, cfg, dp) for cfg, dp in layouts]


def test_decoupled_lr_and_per_token_loss_match_one_process(dist_pool):
    layouts = [
        (_config(flag, tp, pp, stage), dp) for flag, (_, shapes) in FLAGS.items() for tp, pp, dp, stage in shapes
    ]
    per_rank = dist_pool(2).run(many_layouts, layouts)
    results = iter([list(r) for r in zip(*per_rank)])
    for flag, (_, shapes) in FLAGS.items():
        ref = run_training(_config(flag), ProcessGroups.single())
        ref_params = strip_padding(assemble_params([ref]), VOCAB)
        for tp, pp, dp, stage in shapes:
            got, what = next(results), f"{flag} tp{tp} pp{pp} dp{dp} zero{stage}"
            assert_close(last_stage_result(got)["losses"], ref["losses"], f"{what}: losses")
            assert_params_match(strip_padding(assemble_params(got), VOCAB), ref_params, what)


def test_decoupled_lr_and_per_token_loss_are_their_meaning():
    """One process against torch: AdamW with the embedding / output layer in a second param group
    whose rate follows the schedule from --decoupled-lr, on the float64 cross entropy of the logits
    summed over every token of the step's global batch (which the ramp changes) over its token count."""
    from megazero.data.synthetic import ArithmeticTokens
    from megazero.training.lr_schedule import learning_rate
    from megazero.models.gpt import GPT
    from megazero.zero.state_access import safe_get_full_fp32_param

    cfg = _ramped(_decoupled(small_config(steps=6, lr=2e-3)))
    cfg.optimizer.decay_style = "linear"
    initial = {}

    def keep_initial(state):
        initial.update({n: safe_get_full_fp32_param(p).clone() for n, p in state.chunks[0].named_parameters()})

    ours = run_training(cfg, ProcessGroups.single(), on_setup=keep_initial)
    model = GPT(cfg.model)
    assert not model.load_state_dict(initial, strict=False).unexpected_keys
    special = ("embedding.word.weight", "output_head.weight")
    params = dict(model.named_parameters())
    opt = cfg.optimizer
    groups = [
        {
            "params": [p for n, p in params.items() if (n in special) == s and (p.dim() > 1) == d],
            "weight_decay": opt.adam.weight_decay if d else 0.0,
            "decoupled": s,
        }
        for s in (False, True)
        for d in (False, True)
    ]
    adamw = torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=opt.lr, betas=(opt.adam.beta1, opt.adam.beta2), eps=opt.adam.eps
    )
    data = ArithmeticTokens(VOCAB, cfg.model.seq_length, seed=3)
    losses = []
    for it in range(cfg.train_iters):
        start, size = cfg.consumed_before(it), cfg.batch_at(it)
        tokens = torch.stack([torch.as_tensor(data[start + k]["tokens"]) for k in range(size)])
        logits = model(tokens[:, :-1]).double()
        loss = (
            torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1), reduction="sum"
            )
            / tokens[:, 1:].numel()
        )
        adamw.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optimizer.clip_grad)
        at = start + 1  # Megatron's rate after the samples of the steps before
        for group in adamw.param_groups:
            group["lr"] = (
                learning_rate(opt, at, 0, opt.decoupled_lr, opt.decoupled_min_lr)
                if group["decoupled"]
                else learning_rate(opt, at, 0)
            )
        adamw.step()
        losses.append(loss.item())
    assert_close(ours["losses"], losses, "losses")
    reference = {n: p.detach() for n, p in model.named_parameters()}
    assert_params_match(
        strip_padding(assemble_params([ours]), VOCAB), strip_padding(reference, VOCAB), "against torch AdamW"
    )


# --- the batch ramp ---------------------------------------------------------------------------------
def megatron_ramp(start, increment, ramp_samples, global_batch, train_samples):
    """Megatron's calculator and update_train_iters, restated: per iteration the batch taken after
    `consumed` samples, and the iteration count of a --train-samples run."""
    per_increment = ramp_samples / ((global_batch - start) // increment)

    def current(consumed):
        return global_batch if consumed > ramp_samples else start + int(consumed / per_increment) * increment

    iterations = consumed = 0
    while consumed <= ramp_samples and consumed <= train_samples:
        consumed += current(consumed)
        iterations += 1
    if train_samples > consumed:
        iterations += (train_samples - consumed) // global_batch
    sizes, consumed = [], 0
    for _ in range(iterations):
        sizes.append(current(consumed))
        consumed += sizes[-1]
    return iterations, sizes


@pytest.mark.parametrize(
    "ramp,train_samples",
    [((16, 16, 5859375 // 1000, 1536), 40000), ((4, 4, 100, 32), 1000), ((8, 8, 1, 64), 300), ((2, 2, 7, 8), 9)],
)
def test_ramp_batches_equal_megatrons_formula(ramp, train_samples):
    start, increment, samples, glob = ramp
    argv = [
        "--global-batch-size",
        str(glob),
        "--micro-batch-size",
        "1",
        "--train-samples",
        str(train_samples),
        "--rampup-batch-size",
        str(start),
        str(increment),
        str(samples),
    ]
    cfg = config_from_args(parse_args(argv))
    iterations, sizes = megatron_ramp(start, increment, samples, glob, train_samples)
    assert cfg.train_iters == iterations
    assert [cfg.batch_at(i) for i in range(iterations)] == sizes
    assert [cfg.consumed_before(i) for i in range(iterations + 1)] == [0] + list(np.cumsum(sizes))


def test_resume_mid_ramp_is_exact(tmp_path, capsys):
    """A run stopped inside the ramp and resumed from its checkpoint logs what the unbroken run logs."""
    common = [
        "--mock-data",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "64",
        "--num-layers",
        "2",
        "--hidden-size",
        "32",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "16",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "8",
        "--rampup-batch-size",
        "2",
        "2",
        "12",
        "--train-samples",
        "40",
        "--lr-warmup-samples",
        "4",
        "--log-interval",
        "1",
        "--eval-iters",
        "0",
        "--num-workers",
        "0",
        "--decoupled-lr",
        "3e-3",
    ]
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert launch.main(common + ["--run-dir", str(whole)]) == 0, capsys.readouterr().err
    stop = common + ["--run-dir", str(part), "--save", str(part / "ckpt"), "--exit-interval", "4"]
    assert launch.main(stop) == 0, capsys.readouterr().err
    resume = common + ["--run-dir", str(part), "--load", str(part / "ckpt")]
    assert launch.main(resume) == 0, capsys.readouterr().err
    expected, got = split_records(whole), split_records(part)
    assert [r["global_batch_size"] for r in expected] == [2, 2, 4, 6, 8, 8, 8]
    assert [r["iteration"] for r in got] == [r["iteration"] for r in expected]
    for a, b in zip(got, expected):
        assert (a["loss"], a["lr"], a["decoupled_lr"], a["consumed_samples"]) == (
            b["loss"],
            b["lr"],
            b["decoupled_lr"],
            b["consumed_samples"],
        ), a["iteration"]


# --- flags' checks and notes -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "flags,message",
    [
        (["--decoupled-min-lr", "1e-5"], "--decoupled-min-lr needs --decoupled-lr"),
        (["--decoupled-lr", "1e-5", "--min-lr", "1e-4", "--lr", "1e-3"], "--decoupled-lr 1e-05 is below its minimum"),
        (
            ["--rampup-batch-size", "3", "2", "10", "--global-batch-size", "8", "--micro-batch-size", "1"],
            "is not a multiple of INCREMENT 2",
        ),
        (
            ["--rampup-batch-size", "2", "2", "10", "--global-batch-size", "8", "--micro-batch-size", "4"],
            "the ramp's batch 2 does not split into micro batch 4",
        ),
        (
            ["--rampup-batch-size", "8", "2", "10", "--global-batch-size", "8", "--micro-batch-size", "1"],
            "START must be below --global-batch-size 8",
        ),
        (
            ["--rampup-batch-size", "2", "2", "0", "--global-batch-size", "8", "--micro-batch-size", "1"],
            "START, INCREMENT and SAMPLES must be >= 1",
        ),
        (["--manual-gc-interval", "5"], "--manual-gc-interval needs --manual-gc"),
        (["--profile", "--profile-step-start", "4", "--profile-step-end", "4"], "--profile-step-start 4 must be"),
        (["--profile", "--profile-ranks", "0", "3"], "--profile-ranks 3 is not a rank of this 2-rank run"),
        (["--mock-data", "--data-path", "x"], "--mock-data and --data-path are both set"),
        (["--data-path", "x", "--train-data-path", "y"], "--data-path and --train-data-path are both set"),
        (["--valid-data-path", "y"], "--valid-data-path needs --train-data-path"),
        (["--mock-data", "--test-data-path", "y"], "--mock-data and --test-data-path are both set"),
        (["--object-storage-cache-path", "/tmp/c"], "megazero reads data from local files only"),
        (["--num-dataset-builder-threads", "0"], "--num-dataset-builder-threads"),
    ],
)
def test_bad_run_flags_are_one_line(flags, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config_from_args(parse_args(flags), world_size=2)


def test_accepted_flags_and_their_settings():
    cfg = config_from_args(
        parse_args(
            [
                "--use-mcore-models",
                "--log-throughput",
                "--no-create-attention-mask-in-dataloader",
                "--ckpt-format",
                "torch_dist",
                "--log-timers-to-tensorboard",
                "--manual-gc",
                "--manual-gc-interval",
                "3",
                "--empty-unused-memory-level",
                "2",
                "--log-params-norm",
                "--log-num-zeros-in-grad",
            ]
        )
    )
    assert (
        sum(
            n.split(" ")[0]
            in ("--use-mcore-models", "--log-throughput", "--ckpt-format", "--no-create-attention-mask-in-dataloader")
            for n in cfg.notes
        )
        == 4
    )
    assert cfg.wall_clock_breakdown and cfg.run.manual_gc_interval == 3 and cfg.run.empty_unused_memory_level == 2


def test_sequence_parallel_at_tensor_parallel_1_is_noted():
    """(Planted: no note, as before, fails the first check.)"""
    notes = config_from_args(parse_args(["--sequence-parallel"]), world_size=2).notes
    assert [n for n in notes if n.startswith("--sequence-parallel has no effect at --tensor-model-parallel-size 1")]
    cfg = config_from_args(parse_args(["--sequence-parallel", "--tensor-model-parallel-size", "2"]), world_size=2)
    assert cfg.parallel.sequence_parallel and not any("--sequence-parallel" in n for n in cfg.notes)


@pytest.mark.parametrize("home", ["device", "nvme"])
def test_logged_norms_and_zeros_are_the_models(home, tmp_path):
    """--log-params-norm is the L2 norm of every parameter; --log-num-zeros-in-grad counts the zeros of
    the step's gradients as plain autograd on the same model and batch gives them (the vocabulary's
    padding rows, never used, are among them). Also with stage 3's weights in swap files, two held
    in host memory at a time: the norm reads every unit's chunk through the home."""
    from megazero.models.gpt import GPT
    from megazero.training import setup, train_step
    from megazero.zero.state_access import safe_get_full_fp32_param

    nvme = {
        "offload_param": {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 2},
        "param_persistence_threshold": 0,
    }
    cfg = small_config(
        steps=1, global_batch=4, stage=3 if home == "nvme" else 0, zero_extra=nvme if home == "nvme" else None
    )
    cfg.run.log_num_zeros_in_grad = True
    cfg.model.padded_vocab_size = 64
    state = setup(cfg, ProcessGroups.single())
    initial = {n: safe_get_full_fp32_param(p).clone() for n, p in state.chunks[0].named_parameters()}
    norm, _ = state.engine.counted_stats("fp32")
    # The engine's norms are fp32 norms of slices summed in float64 (zero/precision.py): ~1e-7 off.
    assert norm == pytest.approx(math.sqrt(sum(float(v.double().square().sum()) for v in initial.values())), rel=1e-6)
    batch = microbatches(cfg).batch(0)
    zeros = train_step(state, batch, 1e-3).num_zeros_in_grad
    model = GPT(cfg.model)
    model.load_state_dict(initial, strict=False)
    sum(model(mb[:, :-1], mb[:, 1:]).sum() for mb in batch).backward()
    assert zeros == sum(int((p.grad == 0).sum()) for p in model.parameters()) >= 3 * 32


# --- TikTokenizer ------------------------------------------------------------------------------------
def _tiktoken_vocab(path, merges):
    import base64

    tokens = [bytes([i]) for i in range(256)] + merges
    path.write_text(
        json.dumps(
            [{"rank": i, "token_bytes": base64.b64encode(t).decode(), "token_str": ""} for i, t in enumerate(tokens)]
        )
    )
    return path


def test_tiktokenizer_ids_are_megatrons(tmp_path):
    """Byte-level BPE by rank over the pattern's pieces, ids shifted past the 1000 special tokens
    ("hello" -> he + ll -> hell, o); v1 keeps "HelloWorld" one piece (so "oW" merges), v2 splits it
    at the capital."""
    pytest.importorskip("tiktoken")
    from megazero.data.tokenizer import build_tokenizer

    vocab = _tiktoken_vocab(tmp_path / "vocab.json", [b"he", b"ll", b"hell", b"oW"])
    tok = build_tokenizer("TikTokenizer", tokenizer_model=vocab, tiktoken_pattern="v2", vocab_size=2000)
    assert (tok.vocab_size, tok.eod) == (1260, 2)
    assert tok.encode("hello world") == [1258, 1000 + ord("o")] + [1000 + b for b in b" world"]
    assert tok.decode(tok.encode("hello world")) == "hello world"
    v1 = build_tokenizer("TikTokenizer", tokenizer_model=vocab, tiktoken_pattern="v1", vocab_size=2000)
    assert 1259 in v1.encode("HelloWorld") and 1259 not in tok.encode("HelloWorld")
    cfg = config_from_args(
        parse_args(
            [
                "--mock-data",
                "--tokenizer-type",
                "TikTokenizer",
                "--tokenizer-model",
                str(vocab),
                "--tiktoken-pattern",
                "v1",
                "--vocab-size",
                "1258",
            ]
        )
    )
    assert cfg.model.vocab_size == 1258 and not any("--tiktoken-pattern" in n for n in cfg.notes)


def test_tiktokenizer_without_the_package_is_one_line(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "tiktoken", None)
    vocab = _tiktoken_vocab(tmp_path / "vocab.json", [])
    with pytest.raises(UsageError, match=r"TikTokenizer needs the tiktoken package; install it with pip install"):
        config_from_args(
            parse_args(["--mock-data", "--tokenizer-type", "TikTokenizer", "--tokenizer-model", str(vocab)])
        )


def test_no_mmap_bin_files_reads_the_same_samples(gpt2_data, tmp_path):
    """--no-mmap-bin-files: plain file reads, not a memory map, and the same tokens in every sample."""
    import pickle

    from megazero.data.builders import build_train_valid_test_datasets
    from megazero.data.indexed_dataset import IndexedDataset

    mapped, read = IndexedDataset(gpt2_data["data"]), IndexedDataset(gpt2_data["data"], mmap=False)
    assert isinstance(mapped._tokens, np.memmap) and not isinstance(read._tokens, np.memmap)
    assert all(np.array_equal(mapped[i], read[i]) for i in range(len(mapped)))
    assert read.max_token_id == mapped.max_token_id and pickle.loads(pickle.dumps(read)).mmap is False
    sets = [
        build_train_valid_test_datasets(
            [str(gpt2_data["data"])], "1,0,0", 16, 5, (40, 0, 0), cache_dir=tmp_path, progress=False, mmap=m
        )[0]
        for m in (True, False)
    ]
    assert all(np.array_equal(sets[0][i]["tokens"], sets[1][i]["tokens"]) for i in range(40))


def test_segment_rates_in_every_adam_path():
    """A segment's own lr (a decoupled run's embedding) in adam_step's CPU path and in torch's fused
    kernel (grouped by lr), each equal to the reference Adam at that rate."""
    from megazero.ops.adam import AdamSegment, adam_step, adam_update_fused, adam_update_reference
    from megazero.ops.adam_config import AdamConfig

    config = AdamConfig(weight_decay=0.1)
    g = torch.Generator().manual_seed(0)
    tensors = [
        [torch.randn(33, generator=g).abs() if k == 3 else torch.randn(33, generator=g) for k in range(4)]
        for _ in range(3)
    ]
    rates = [None, 3e-2, 5e-3]

    def fresh():
        return [[t.clone() for t in ts] for ts in tensors]

    expected = fresh()
    for (p, grad, m, v), lr in zip(expected, rates):
        adam_update_reference(p, grad, m, v, step=3, lr=lr or 1e-3, config=config, weight_decay=0.1)
    runs = [lambda segs: adam_step(segs, step=3, lr=1e-3, config=config)]
    if hasattr(torch, "_fused_adamw_"):
        runs.append(lambda segs: adam_update_fused(segs, step=3, lr=1e-3, config=config))
    for run in runs:
        got = fresh()
        run([AdamSegment(p, grad, m, v, 0.1, None, lr) for (p, grad, m, v), lr in zip(got, rates)])
        for a, b in zip(got, expected):
            torch.testing.assert_close(a[0], b[0], rtol=1e-6, atol=1e-7)
