"""ZeRO's books: model-state memory per rank against the ZeRO paper's formula, bytes moved per step
against 2Psi / 3Psi, and the inspection APIs (set, then get) for every stage."""

import pytest
import torch

from tests.layouts import setup_training, small_config, with_padded_vocab
from megazero.parallel.topology import Topology
from megazero.training import train_step
from megazero.zero import state_access as zi
from megazero.models.param_info import param_info


# ZeRO's table, bf16 weights, g-byte gradients, fp32 master + Adam moments (K = 12). With
# grad_accum_dtype bf16 (g = 2) it is the ZeRO paper's; the default accumulates in fp32 (g = 4).
def formula(g):
    return {
        0: lambda psi, n: (2 + g + 12) * psi,
        1: lambda psi, n: (2 + g) * psi + 12 * psi / n,
        2: lambda psi, n: 2 * psi + (g + 12) * psi / n,
        3: lambda psi, n: (2 + g + 12) * psi / n,
    }


FORMULA = formula(4)
FORMULA_BF16_GRADS = formula(2)
# With fp32 weights the master copy is this rank's chunk of the weights themselves (no second
# copy), so K drops to 8 for the separate states and the 2-byte terms become 4.
FORMULA_FP32 = {
    0: lambda psi, n: (4 + 4 + 8) * psi,
    1: lambda psi, n: (4 + 4) * psi + 8 * psi / n,
    2: lambda psi, n: 4 * psi + (4 + 8) * psi / n,
    3: lambda psi, n: (4 + 4 + 8) * psi / n,
}
# Elements moved per step, as (parameter gathers, gradient reductions) in units of Psi.
COMM_PSI = {0: (0, 2), 1: (1, 1), 2: (1, 1), 3: (2, 1)}
ZERO_GROUPS = ("dp", "mics_shard", "mics_shard_gather")


def _config(stage, dp, bf16, grads="fp32"):
    cfg = small_config(
        stage=stage,
        bf16=bf16,
        tied=False,
        micro=2,
        global_batch=2 * dp,
        model_extra={"hidden_size": 64, "ffn_hidden_size": 256},
        zero_extra={"param_persistence_threshold": 0, "max_reuse_distance": 0},
    )
    cfg.zero.reduce_bucket_size = 20000
    cfg.precision.grad_accum_dtype = cfg.precision.reduce_dtype = grads
    return with_padded_vocab(cfg)


def accounting_worker(ctx, stage, bf16, grads="fp32"):
    dp = 4
    groups = ctx.groups(Topology(world_size=dp))
    cfg = _config(stage, dp, bf16, grads)
    state, source = setup_training(cfg, groups, seed=0)
    psi = sum(
        param_info(p).zero_full_shape.numel() if param_info(p).zero_full_shape is not None else p.numel()
        for p in state.engine.parameters()
    )
    report = state.engine.memory.report()
    train_step(state, source.batch(0), 1e-3)
    zero_bytes = sum(b for (op, group, _), b in groups.log.last_step.items() if group in ZERO_GROUPS)
    return psi, report, zero_bytes


@pytest.mark.parametrize("bf16,grads", [(True, "fp32"), (True, "bf16"), (False, "fp32")])
def test_memory_report_matches_formula(dist_pool, bf16, grads):
    table = FORMULA_FP32 if not bf16 else FORMULA if grads == "fp32" else FORMULA_BF16_GRADS
    for stage in range(4):
        psi, report, _ = dist_pool(4).run(accounting_worker, stage, bf16, grads)[0]
        expected = table[stage](psi, 4)
        got = report["model_states"]
        assert abs(got - expected) <= 0.05 * expected, (
            f"stage {stage}: reported {got} bytes, formula {expected:.0f} (psi={psi})"
        )


@pytest.mark.parametrize("grads,grad_bytes", [("fp32", 4), ("bf16", 2)])
def test_comm_bytes_per_step(dist_pool, grads, grad_bytes):
    """Ring convention: every collective moves (n-1)/n of its buffer per rank. bf16 weights are
    gathered in bf16; gradients travel in the reduce dtype (fp32 by default)."""
    n = 4
    for stage in range(4):
        psi, _, moved = dist_pool(4).run(accounting_worker, stage, True, grads)[0]
        gathers, reductions = COMM_PSI[stage]
        expected = (n - 1) / n * psi * (2 * gathers + grad_bytes * reductions)
        assert abs(moved - expected) <= 0.02 * expected, (
            f"stage {stage}: moved {moved} bytes per rank, expected {expected:.0f} ({COMM_PSI[stage]} Psi)"
        )


def inspection_worker(ctx, stage):
    groups = ctx.groups(Topology(world_size=4, tp=2))
    cfg = with_padded_vocab(small_config(stage=stage, tp=2, global_batch=4))
    state, source = setup_training(cfg, groups, seed=0)
    engine, chunk = state.engine, state.chunks[0]
    gen = torch.Generator().manual_seed(5)
    engine.begin_step()
    tokens = source.batch(0)[0]
    engine.backward(chunk(tokens[:, :-1], tokens[:, 1:]).sum())
    pieces = {}
    for name, p in chunk.named_parameters():
        value = zi.safe_get_full_fp32_param(p)
        new = torch.randn(value.shape, generator=gen)
        zi.safe_set_full_fp32_param(p, new)
        assert torch.equal(zi.safe_get_full_fp32_param(p), new), name
        for key in zi.OPTIMIZER_KEYS:
            state_value = torch.rand(value.shape, generator=gen)
            zi.safe_set_full_optimizer_state(p, state_value, key)
            assert torch.equal(zi.safe_get_full_optimizer_state(p, key), state_value), (name, key)
        grad = zi.safe_get_full_grad(p)
        zi.safe_set_full_grad(p, grad * 2)
        assert torch.equal(zi.safe_get_full_grad(p), grad * 2), name
        local_grad = zi.safe_get_local_grad(p)
        zi.safe_set_local_grad(p, local_grad + 3)
        assert torch.equal(zi.safe_get_local_grad(p), local_grad + 3), name
        for key in zi.OPTIMIZER_KEYS:
            local_state = zi.safe_get_local_optimizer_state(p, key)
            zi.safe_set_local_optimizer_state(p, local_state * 2, key)
            assert torch.equal(zi.safe_get_local_optimizer_state(p, key), local_state * 2), (name, key)
        local = zi.safe_get_local_fp32_param(p)
        zi.safe_set_local_fp32_param(p, local + 1)
        assert torch.equal(zi.safe_get_local_fp32_param(p), local + 1)
        pieces[name] = (zi.safe_get_local_fp32_param(p), zi.safe_get_full_fp32_param(p))
    engine.step(lr=0.0)
    try:
        zi.safe_get_full_grad(next(chunk.parameters()))
        raise AssertionError("gradients must not be readable after the step")
    except RuntimeError:
        pass
    return groups.coords.tp, {n: (loc, full) for n, (loc, full) in pieces.items()}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_inspection_apis_round_trip(dist_pool, stage):
    results = dist_pool(4).run(inspection_worker, stage)
    for tp in (0, 1):
        same_tp = [r[1] for r in results if r[0] == tp]
        for name in same_tp[0]:
            full = same_tp[0][name][1]
            assert all(torch.equal(r[name][1], full) for r in same_tp), f"{name}: DP ranks disagree"
            # the DP ranks' local pieces (each shifted by the +1 it set) tile the parameter in order
            if stage == 0:
                assert torch.equal(same_tp[0][name][0], full.flatten()), name
            else:
                assert torch.equal(torch.cat([r[name][0] for r in same_tp]), full.flatten()), name
