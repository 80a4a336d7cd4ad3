"""megazero's accounting against independent measures: the comm log against what torch.distributed
was handed, the step FLOPs against torch's FLOP counter, the memory report against the tensors
alive (test_training_against_torch.py says why these tests exist).
Here the other side is written in the test from torch and from Megatron-LM's / DeepSpeed's
documented rules (reference_rules.py). Each test names, in its docstring, the bugs it was seen to
catch (planted by hand, one at a time; tests/README.md lists them all).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.layouts import setup_training, small_config, with_padded_vocab
from megazero.models.config import GPTConfig
from tests.references.reference_rules import plain_gpt

SEED = 1234


# --- accounting against independent measures ---------------------------------------------------


class WireTap:
    """torch.distributed's collectives wrapped while it is open: every call's process group (its
    global ranks) and the bytes of the tensors it was handed, per rank by the convention CommLog
    documents (ring algorithms: all-reduce 2(n-1)/n of the buffer, all-gather, reduce-scatter,
    all-to-all and broadcast (n-1)/n of the full buffer, point-to-point the tensor). megazero.core.comm
    binds the two collectives torch 2.13 renamed when it is imported; they are wrapped where it
    holds them too."""

    RING = {
        "all_reduce": ("all_reduce", "tensor", 2.0),
        "broadcast": ("broadcast", "tensor", 1.0),
        "all_gather_single": ("all_gather", "output_tensor", 1.0),
        "all_gather_into_tensor": ("all_gather", "output_tensor", 1.0),
        "reduce_scatter_single": ("reduce_scatter", "input", 1.0),
        "reduce_scatter_tensor": ("reduce_scatter", "input", 1.0),
        "all_to_all_single": ("all_to_all", "input", 1.0),
    }

    def __init__(self):
        import torch.distributed as dist
        import megazero.core.comm as comm

        self.bytes: dict[tuple[str, tuple], float] = {}
        self._undo = []
        for name in self.RING:
            if hasattr(dist, name):
                self._wrap(dist, name, getattr(dist, name))
        for seam in (comm.all_gather_single, comm.reduce_scatter_single):  # the comm layer's own names
            self._wrap(seam, "impl", seam.impl, seam.impl.__name__)
        self._wrap(dist, "batch_isend_irecv", dist.batch_isend_irecv)

    def _wrap(self, module, attr, original, name=None):
        import functools
        import inspect
        import torch.distributed as dist

        name = name or attr
        signature = inspect.signature(original)

        @functools.wraps(original)
        def counted(*args, **kwargs):
            bound = signature.bind(*args, **kwargs).arguments
            if name == "batch_isend_irecv":
                for op in bound["p2p_op_list"]:
                    kind = "send" if op.op.__name__ == "isend" else "recv"
                    self._add(kind, op.group, op.tensor.numel() * op.tensor.element_size())
            else:
                op, tensor_arg, factor = self.RING[name]
                group = bound.get("group")
                n = dist.get_world_size(group)
                tensor = bound[tensor_arg]
                self._add(op, group, factor * (n - 1) / n * tensor.numel() * tensor.element_size())
            return original(*args, **kwargs)

        setattr(module, attr, counted)
        self._undo.append((module, attr, original))

    def _add(self, op: str, group, nbytes: float) -> None:
        import torch.distributed as dist

        ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
        self.bytes[(op, ranks)] = self.bytes.get((op, ranks), 0.0) + nbytes

    def close(self) -> None:
        for module, attr, original in reversed(self._undo):
            setattr(module, attr, original)


def commlog_bytes(groups) -> dict[tuple[str, tuple], float]:
    """CommLog's whole-run byte counts, keyed like WireTap's: (op, the group's global ranks)."""
    out: dict[tuple[str, tuple], float] = {}
    for (op, kind, _), nbytes in groups.log.total_bytes.items():
        key = (op, tuple(getattr(groups, kind).ranks))
        out[key] = out.get(key, 0.0) + nbytes
    return out


def tapped_worker(ctx, layouts) -> list:
    """Pool entry: trains each (config, topology) 2 steps with torch.distributed tapped; returns
    per layout the tap's and CommLog's bytes."""
    from tests.layouts import run_training

    out = []
    for cfg, topology in layouts:
        groups = ctx.groups(topology)
        tap = WireTap()
        try:
            run_training(cfg, groups)
        finally:
            tap.close()
        out.append((tap.bytes, commlog_bytes(groups)))
    return out


def test_comm_log_counts_what_torch_distributed_was_handed(dist_pool):
    """CommLog's bytes per op and group over whole runs (set-up included) equal the bytes of the
    tensors handed to torch.distributed's own collectives, counted by wrapping them: ZeRO-3 at dp 2
    with qwZ and qgZ (all-gather, reduce-scatter, all-to-all, all-reduce), tp 2 (all-reduce), pp 2
    1F1B with a tied embedding (send/recv, broadcast, all-reduce).

    Kills: an all-gather counted twice; a broadcast counted twice. (A collective that bypassed
    megazero.core.comm would show up as bytes CommLog lacks.)"""
    from megazero.parallel.topology import Topology

    zeropp = {"zero_quantized_weights": True, "zero_quantized_gradients": True}
    layouts = {
        "ZeRO-3 dp 2, qwZ + qgZ, 2 nodes": (
            small_config(stage=3, steps=2, layers=2, zero_extra=zeropp),
            Topology(world_size=2, ranks_per_node=1),
        ),
        "tp 2": (small_config(tp=2, steps=2, layers=2), Topology(world_size=2, tp=2)),
        "pp 2 1F1B, ZeRO-1": (
            small_config(pp=2, stage=1, schedule="1f1b", steps=2, layers=2),
            Topology(world_size=2, pp=2),
        ),
    }
    results = dist_pool(2).run(tapped_worker, list(layouts.values()))
    ops = set()
    for rank, per_rank in enumerate(results):
        for what, (tapped, logged) in zip(layouts, per_rank):
            assert logged.keys() == tapped.keys(), f"{what} rank {rank}: {sorted(logged)} vs {sorted(tapped)}"
            for key, nbytes in tapped.items():
                assert logged[key] == pytest.approx(nbytes, rel=1e-12), f"{what} rank {rank}: {key}"
            ops.update(op for op, _ in tapped)
    assert ops == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send", "recv"}, ops


@pytest.mark.parametrize("activation,query_groups", [("gelu", 4), ("swiglu", 2)])
def test_step_flops_match_torch_flop_counter_on_the_math_attention_kernel(activation, query_groups):
    """megazero.training.flops' count of a training step (the MFU numerator) equals what torch's
    FlopCounterMode counts over a real forward and backward of the GPT, attention included: on the
    math SDPA backend attention runs as matmuls the counter sees (the CPU flash kernel it does not
    see). Causal attention is counted in full on both sides (the math kernel masks after the matmul: the
    older count, causal_at_half=False; MFU counts it at half, as Megatron-LM now does).

    Kills: the older count (causal_at_half=False) halving the attention anyway."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode
    from megazero.training.flops import forward_flops_per_token, step_flops

    # No vocabulary padding: flops.py counts the padded vocabulary (Megatron's convention) while the
    # fused loss multiplies only the real rows on one device.
    cfg = GPTConfig(
        vocab_size=128,
        padded_vocab_size=128,
        hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        num_query_groups=query_groups,
        ffn_hidden_size=256,
        seq_length=32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        activation=activation,
    )
    model = plain_gpt(cfg, SEED)
    tokens = torch.randint(0, cfg.vocab_size, (3, cfg.seq_length + 1), generator=torch.Generator().manual_seed(0))
    count = tokens.shape[0] * cfg.seq_length
    with sdpa_kernel(SDPBackend.MATH):
        with FlopCounterMode(display=False) as forward:
            loss = model(tokens[:, :-1], tokens[:, 1:]).sum()
        with FlopCounterMode(display=False) as backward:
            loss.backward()
    assert forward.get_total_flops() == forward_flops_per_token(cfg, causal_at_half=False) * count
    # The fused loss (models/loss.py) runs these 96 tokens' head as one chunk and keeps its softmax
    # from the forward: the backward recomputes no logits, so the step is exactly the model FLOPs.
    # (A head cut into chunks recomputes each chunk's logits: one more output-layer matmul.)
    assert forward.get_total_flops() + backward.get_total_flops() == step_flops(cfg, count, causal_at_half=False)
    from megazero.models.loss import linear_cross_entropy

    x = torch.randn(count, cfg.hidden_size, requires_grad=True)
    weight = torch.randn(cfg.padded_vocab_size, cfg.hidden_size, requires_grad=True)
    labels = tokens[:, 1:].reshape(-1)
    with FlopCounterMode(display=False) as chunked:
        linear_cross_entropy(x, weight, labels, cfg.vocab_size, chunk_tokens=count // 3).sum().backward()
    assert chunked.get_total_flops() == 4 * 2 * count * cfg.hidden_size * cfg.padded_vocab_size


def live_tensor_bytes(root) -> int:
    """Bytes of the distinct tensor storages reachable from `root` (attributes, containers,
    closures: anything it keeps alive; not the globals of the modules its functions come from),
    except RNG states (the recompute function reaches the model's RNG tracker; they are not model
    states)."""
    import gc
    import types
    from megazero.parallel.random import RNGTracker

    skip = (str, bytes, int, float, bool, type(None), types.ModuleType, type, RNGTracker)
    seen, storages, stack = set(), {}, [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, skip):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.device.type != "meta":
                storage = obj.untyped_storage()
                storages[(storage.data_ptr(), str(obj.device))] = storage.nbytes()
            continue
        if isinstance(obj, types.FunctionType):  # its closure and defaults, not its module's globals
            for cell in obj.__closure__ or ():
                with contextlib.suppress(ValueError):  # an empty cell
                    stack.append(cell.cell_contents)
            stack.extend((obj.__defaults__, obj.__kwdefaults__))
            continue
        stack.extend(gc.get_referents(obj))
    return sum(storages.values())


def memory_worker(ctx, stage: int, bf16: bool) -> list:
    """Pool entry (2 ranks): 2 steps at ZeRO `stage`; at each step's peak of model states (gradients
    reduced, before the optimizer) the bytes alive under the engine and its memory report."""
    from megazero.parallel.topology import Topology
    from megazero.training import train_step

    groups = ctx.groups(Topology(world_size=2))
    cfg = with_padded_vocab(small_config(stage=stage, steps=2, layers=2, bf16=bf16))
    state, source = setup_training(cfg, groups)
    engine, measured = state.engine, []
    step = engine.step

    def measuring_step(lr):
        engine.finish_gradients()
        measured.append((live_tensor_bytes(engine), engine.memory.report()))
        return step(lr)

    engine.step = measuring_step
    for i in range(2):
        train_step(state, source.batch(i), 1e-3)
    return measured


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_memory_report_matches_the_tensors_alive(dist_pool, bf16):
    """The engine's memory report (model states + buffers + gathered parameters) equals the bytes
    of the tensors the engine keeps alive, found by walking everything reachable from it, at the
    peak of each step (gradients reduced, optimizer not yet run), ZeRO 0-3 at dp 2.

    At that moment and not between steps: ZeRO 2/3 free their gradient partitions' storage after
    the step, while the report still counts them (it gives the step's peak).

    Kills: an Adam moment left out of optimizer_states."""
    for stage in range(4):
        for rank, measured in enumerate(dist_pool(2).run(memory_worker, stage, bf16)):
            for i, (alive, report) in enumerate(measured):
                reported = report["model_states"] + report["buffers"] + report["live_params"]
                assert alive == reported, (
                    f"stage {stage} rank {rank} step {i + 1}: {alive} bytes alive, {reported} reported ({report})"
                )
