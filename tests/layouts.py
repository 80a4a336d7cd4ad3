"""Shared helpers for the exactness tests: train a small GPT under a given layout on synthetic
tokens and return its loss curve and its full final parameters, for comparison with the
single-process run of the same code."""

from __future__ import annotations

import types

import pytest
import torch

from megazero.config.train_config import OptimizerConfig, ParallelConfig, TrainConfig
from megazero.data.synthetic import ArithmeticTokens
from megazero.training.lr_schedule import step_learning_rate
from megazero.models.config import GPTConfig
from megazero.models.gpt import TransformerLayer
from megazero.parallel.process_groups import ProcessGroups
from megazero.parallel.topology import Topology
from tests.references.reference_rules import without_key_bias
from megazero.data.sampler import MicrobatchSource
from megazero.training import setup, train_step
from megazero.ops.adam_config import AdamConfig
from megazero.zero.config import ZeroConfig
from megazero.zero.state_access import safe_get_full_fp32_param
from megazero.models.param_info import param_info

RTOL = 1e-5
VOCAB = 61  # small_config's vocabulary
SMALL_HIDDEN, SMALL_HEADS = 32, 4  # small_config's width and attention heads


def small_config(
    tp=1,
    pp=1,
    stage=0,
    *,
    steps=10,
    micro=2,
    global_batch=16,
    layers=4,
    tied=True,
    sequence_parallel=False,
    virtual=1,
    schedule="auto",
    mics=-1,
    zero_extra=None,
    model_extra=None,
    bf16=False,
    clip=0.05,
    lr=1e-3,
    layer_split=None,
    cp=1,
    cp_comm_type="p2p",
    ep=1,
    moe_dispatcher="alltoall",
    etp=0,
) -> TrainConfig:
    shape = dict(
        vocab_size=VOCAB,
        padded_vocab_size=0,
        hidden_size=SMALL_HIDDEN,
        num_layers=layers,
        num_attention_heads=SMALL_HEADS,
        ffn_hidden_size=64,
        seq_length=16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tie_embeddings=tied,
    )
    model = GPTConfig(**{**shape, **(model_extra or {})})
    zero_settings = dict(
        stage=stage,
        reduce_bucket_size=1500,
        allgather_bucket_size=3000,
        param_persistence_threshold=40,
        prefetch_bucket_size=5000,
        mics_shard_size=mics,
    )
    zero = ZeroConfig(**{**zero_settings, **(zero_extra or {})})
    opt = OptimizerConfig(
        lr=lr,
        min_lr=lr / 10,
        warmup_iters=2,
        decay_style="cosine",
        adam=AdamConfig(lr=lr, weight_decay=0.1),
        clip_grad=clip,
    )
    cfg = TrainConfig(
        model=model,
        zero=zero,
        optimizer=opt,
        micro_batch_size=micro,
        global_batch_size=global_batch,
        train_iters=steps,
        seed=7,
        parallel=ParallelConfig(
            tensor_parallel=tp,
            pipeline_parallel=pp,
            sequence_parallel=sequence_parallel,
            context_parallel=cp,
            cp_comm_type=cp_comm_type,
            expert_parallel=ep,
            moe_dispatcher=moe_dispatcher,
            expert_tensor_parallel=etp,
            virtual_stages=virtual,
            schedule=schedule,
            layer_split=layer_split,
        ),
    )
    cfg.precision.bf16 = bf16
    return cfg


def with_padded_vocab(cfg: TrainConfig) -> TrainConfig:
    from megazero.models.config import padded_vocab_size

    cfg.model.padded_vocab_size = padded_vocab_size(cfg.model.vocab_size, 8, cfg.parallel.tensor_parallel)
    return cfg


def microbatches(
    cfg: TrainConfig,
    groups: ProcessGroups | None = None,
    *,
    dp_rank: int | None = None,
    dp: int | None = None,
    seed: int = 3,
    dataset=None,
) -> MicrobatchSource:
    """This rank's microbatches of cfg's global batches (and its batch ramp, if any) from `dataset`
    (default: ArithmeticTokens of cfg's vocabulary and sequence length, seeded by `seed`). The DP
    position is the groups' (groups None: the one process's); `dp_rank` and `dp` override it (a
    peer's rank that has no groups)."""
    if dataset is None:
        dataset = ArithmeticTokens(cfg.model.vocab_size, cfg.model.seq_length, seed=seed)
    if dp_rank is None:
        dp_rank = groups.coords.dp if groups is not None else 0
    if dp is None:
        dp = groups.topology.dp if groups is not None else 1
    return MicrobatchSource(dataset, cfg.global_batch_size, cfg.micro_batch_size, dp_rank, dp, ramp=cfg.rampup)


def setup_training(cfg: TrainConfig, groups: ProcessGroups, *, seed: int = 3, dataset=None, **setup_options):
    """The prologue of a hand-written training loop: cfg's vocabulary padded (in place, as the
    launch pads it), the model and engine built by training.setup, and microbatches(...). Returns
    (state, source)."""
    cfg = with_padded_vocab(cfg)
    state = setup(cfg, groups, **setup_options)
    return state, microbatches(cfg, groups, seed=seed, dataset=dataset)


def run_training(cfg: TrainConfig, groups: ProcessGroups, on_setup=None, dataset=None, eod=None) -> dict:
    """Trains cfg.train_iters steps; returns losses, grad norms and this rank's full parameters.
    `on_setup(state)` may look at the built model (register hooks) before the first step; `dataset`:
    the samples (default ArithmeticTokens); `eod`: the end-of-document id cfg.data's document flags
    look for."""
    state, source = setup_training(cfg, groups, dataset=dataset, eod=eod)  # pads cfg's vocabulary
    if on_setup is not None:
        on_setup(state)
    losses, norms, in_flight, moe, deferred = [], [], [], [], []
    for it in range(cfg.train_iters):
        lr = step_learning_rate(cfg.optimizer, it + 1, cfg.train_iters, cfg.consumed_before(it))
        step = train_step(state, source.batch(it), lr)
        losses.append(step.loss)
        norms.append(step.grad_norm)
        in_flight.append(step.max_in_flight)
        deferred.append(step.max_deferred_w)
        moe.append(step.moe)
    params = {}
    for chunk in state.chunks:
        for name, p in chunk.named_parameters():
            params[name] = (safe_get_full_fp32_param(p), param_info(p).tp_shard)
    return {
        "coords": tuple(groups.coords),
        "losses": losses,
        "norms": norms,
        "params": params,
        "moe": moe,
        "ep_rank": groups.topology.ep_of(groups.rank),
        "edp_rank": groups.edp.rank,
        "cp_rank": groups.topology.cp_of(groups.rank),
        "in_flight": max(in_flight, default=0),
        "deferred_w": max(deferred, default=0),
        "memory": state.engine.memory.report(),
        "comm": dict(groups.log.last_step),
    }


def layout_worker(ctx, cfg: TrainConfig, dp: int, on_setup=None, **data):
    """Pool entry: runs `cfg` on the first tp*cp*pp*dp ranks of the pool's world (`data`: run_training's
    dataset and eod)."""
    par = cfg.parallel
    world = par.tensor_parallel * par.context_parallel * par.pipeline_parallel * dp
    groups = ctx.groups(
        Topology(
            world_size=world,
            tp=par.tensor_parallel,
            pp=par.pipeline_parallel,
            cp=par.context_parallel,
            ep=par.expert_parallel,
            etp=par.expert_tensor_parallel,
            mics_shard_size=cfg.zero.mics_shard_size,
        )
    )
    if groups is None:
        return None
    return run_training(cfg, groups, on_setup, **data)


def run_layouts(ctx, layouts):
    """Pool entry: trains each (config, dp) in turn; ranks outside a layout give None for it.
    Each result also counts the transformer layers' forward calls (recompute runs each twice; a
    pre-hook, since the recomputation stops as soon as it has what backward needs)."""
    calls = [0]

    def count(module, args):
        calls[0] += isinstance(module, TransformerLayer)

    out = []
    for cfg, dp in layouts:
        calls[0] = 0
        handle = torch.nn.modules.module.register_module_forward_pre_hook(count)
        try:
            result = layout_worker(ctx, cfg, dp)
        finally:
            handle.remove()
        if result is not None:
            result["layer_forwards"] = calls[0]
        out.append(result)
    return out


def per_layout(pool_results):
    """Per-rank lists of per-layout results -> per-layout lists of per-rank results."""
    return [list(results) for results in zip(*pool_results)]


_REFERENCES: dict[str, tuple[dict, dict]] = {}


def single_process_reference(**config) -> tuple[dict, dict]:
    """(result, full parameters without vocabulary padding) of run_training(small_config(**config))
    in one process; run once per session per config, since several files compare with the same one."""
    key = repr(sorted(config.items()))
    if key not in _REFERENCES:
        result = run_training(small_config(**config), ProcessGroups.single())
        _REFERENCES[key] = result, strip_padding(assemble_params([result]), VOCAB)
    return _REFERENCES[key]


def reference_fixture(**config):
    """A module-scoped `reference` fixture holding single_process_reference(**config); a test file
    takes it with `reference = reference_fixture(steps=STEPS)`."""

    @pytest.fixture(scope="module")
    def reference():
        return single_process_reference(**config)

    return reference


def assert_matches_reference(results: list[dict], reference: tuple[dict, dict], what: str) -> None:
    """A layout's per-rank results against the single-process run: the loss curve and the gradient
    norms elementwise, the final parameters per tensor (rtol 1e-5)."""
    ref, ref_params = reference
    got = last_stage_result(results)
    assert_close(got["losses"], ref["losses"], f"{what}: loss curve")
    assert_close(got["norms"], ref["norms"], f"{what}: grad norms")
    assert_params_match(strip_padding(assemble_params(results), VOCAB), ref_params, what)


def assemble_params(results: list[dict]) -> dict[str, torch.Tensor]:
    """Full parameters from every rank's TP-local ones (DP rank 0 of each TP/PP position)."""
    pieces: dict[str, dict[int, tuple]] = {}
    for r in results:
        if r is None:
            continue
        tp, dp, pp = r["coords"]
        if dp != 0:
            continue
        for name, (value, shard) in r["params"].items():
            pieces.setdefault(name, {})[tp] = (value, shard)
    full = {}
    for name, by_tp in pieces.items():
        value, shard = by_tp[0]
        if shard is None:
            full[name] = value
        else:
            full[name] = shard.full_from_locals([by_tp[t][0] for t in sorted(by_tp)])
    return full


def strip_padding(params: dict[str, torch.Tensor], vocab: int) -> dict[str, torch.Tensor]:
    """Drops vocabulary padding rows."""
    return {n: (v[:vocab] if n in ("embedding.word.weight", "output_head.weight") else v) for n, v in params.items()}


def drop_tied_copy(params: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> dict:
    """A pipeline split of a tied model has the output head's copy of the word embedding; it must
    equal the embedding bit for bit, and is then dropped to compare with the unsplit reference."""
    if "output_head.weight" in params and "output_head.weight" not in reference:
        copy = params.pop("output_head.weight")
        assert torch.equal(copy, params["embedding.word.weight"]), "tied embedding copies drifted apart"
    return params


def last_stage_result(results: list[dict]) -> dict:
    """A result from a last-stage rank (all ranks report the same losses; pick one that has them)."""
    return max((r for r in results if r is not None), key=lambda r: r["coords"][2])


def _small_attention(params: dict):
    """small_config's attention shape (hidden 32, 4 heads of 8; the query groups read from the qkv
    bias's size) for reference_rules.without_key_bias; None for another shape (compared whole)."""
    head_dim, heads = SMALL_HIDDEN // SMALL_HEADS, SMALL_HEADS
    for name, tensor in params.items():
        if name.endswith("attention.qkv.bias"):
            rows, groups = tensor.numel() // head_dim, (tensor.numel() // head_dim - heads) // 2
            if tensor.numel() % head_dim or groups < 1 or heads % groups or groups * (heads // groups + 2) != rows:
                return None
            return types.SimpleNamespace(hidden_size=SMALL_HIDDEN, num_attention_heads=heads, num_query_groups=groups)
    return None


def assert_params_match(actual: dict, expected: dict, what: str):
    """Per tensor, ||actual - expected|| <= 1e-5 ||expected||, the attention key bias left out.

    Not elementwise: Adam divides each element's gradient by its own RMS, so an element whose true
    gradient is ~0 moves by up to lr x eps-limited noise whatever the layout. The key bias is such
    a part, wholly: adding one vector to every key adds one number to every score of a query's row,
    which the softmax ignores, so its gradient is rounding noise alone, which Adam amplifies (measured:
    its rows 5e-6 to 1.1e-5 of the tensor's norm on one machine, the query and value rows of the same
    tensor 2-3e-7). So its rows are compared with nothing: they carry no sign of a layout's
    correctness. (With RoPE the key bias is rotated per position and does get a gradient; it is left
    out there too, a small loss: the losses and the query/value rows still see it.) The single-process run against itself with another microbatch size (pure reduction
    order) calibrates the rest; see test_reference_noise_floor.
    """
    actual = drop_tied_copy(dict(actual), expected)
    assert actual.keys() == expected.keys(), f"{what}: parameter names differ"
    shape = _small_attention(expected)
    if shape is not None:
        actual, expected = without_key_bias(actual, shape), without_key_bias(expected, shape)
    for name in expected:
        gap = float((actual[name].double() - expected[name].double()).norm())
        scale = float(expected[name].double().norm())
        assert gap <= RTOL * scale, f"{what}: {name} differs by {gap / scale:.2e} (relative L2)"


def assert_close(actual, expected, what: str):
    actual, expected = torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64)
    atol = RTOL * float(expected.abs().max())
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=atol, msg=lambda m: f"{what}: {m}")
