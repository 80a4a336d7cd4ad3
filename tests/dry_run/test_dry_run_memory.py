"""The dry run's memory model: attention as the GPU's kernel allocates it, activations by what
autograd keeps, the caching allocator's segments, and the planner against the dry run."""

from __future__ import annotations

import contextlib

import pytest
import torch

from megazero.dry_run.gpu_kernels import gpu_attention, kernel_for
from megazero.dry_run.device_stand_in import DeviceStandIn
from megazero.models.attention import core_attention


def _attention_memory(dtype, groups: int, patched: bool, documents=None):
    """(peak bytes, bytes kept for the backward) of one causal attention's forward on meta."""
    b, s, heads, d = 1, 2048, 8, 64
    with (
        DeviceStandIn() as device,
        device.keeping_activations(),
        gpu_attention() if patched else contextlib.nullcontext(),
    ):
        q = torch.empty(b, s, heads, d, device="meta", dtype=dtype, requires_grad=True)
        k = torch.empty(b, s, groups, d, device="meta", dtype=dtype, requires_grad=True)
        v = torch.empty(b, s, groups, d, device="meta", dtype=dtype, requires_grad=True)
        device.in_setup = False  # q, k, v count as model states: what follows is attention's
        base = sum(device.live.values())
        with torch.enable_grad():
            out = core_attention(q, k, v, documents=documents)
        kept = device.live["activations"]
        out.sum().backward()
    return device.peak - base, kept, out


def test_attention_on_meta_keeps_what_the_flash_kernel_keeps():
    b, s, heads, d = 1, 2048, 8, 64
    peak, kept, out = _attention_memory(torch.bfloat16, 2, patched=True)
    assert out.shape == (b, s, heads * d) and out.dtype == torch.bfloat16
    # flash-attention's forward returns the output (b, h, s, d) in 16 bits and the log-sum-exp
    # (b, h, s) in fp32 (torch's _scaled_dot_product_flash_attention), and its two 8-byte philox
    # seed and offset, one 512-byte block each: nothing sequence-squared.
    assert kept == b * heads * s * d * 2 + b * heads * s * 4 + 2 * 512
    assert peak < b * heads * s * s  # not even one byte per score
    # The math path (what meta picks by itself) keeps the fp32 probabilities.
    math_peak, math_kept, _ = _attention_memory(torch.bfloat16, 2, patched=False)
    assert math_kept >= b * heads * s * s * 4 and math_peak > 4 * peak


def test_packed_documents_on_a_simulated_gpu_keep_what_the_causal_flash_call_keeps():
    """--reset-attention-mask on CUDA runs a varlen kernel (FlashAttention's, FlexAttention's), which
    keeps the output and one log-sum-exp per query, as one causal flash call over the sequence:
    the simulated GPU counts that call's memory, not the CPU's per-document calls'.
    Planted (meta running the per-document calls): kept differs (less: the calls are recomputed)."""
    from megazero.models.documents import DocumentMasking, pack_documents

    tokens = torch.randint(2, 50, (1, 2048), generator=torch.Generator().manual_seed(0))
    tokens[0, [99, 700, 1500]] = 1
    documents, _ = pack_documents(tokens, DocumentMasking(1, True, True, True))
    whole_peak, whole_kept, _ = _attention_memory(torch.bfloat16, 2, patched=True)
    peak, kept, out = _attention_memory(torch.bfloat16, 2, patched=True, documents=documents.to(lambda t: t.to("meta")))
    assert out.shape == (1, 2048, 8 * 64) and (peak, kept) == (whole_peak, whole_kept)


def test_kernel_choice_follows_cudas_rules():
    def t(dtype, heads, d=64):
        return torch.empty(1, heads, 16, d, device="meta", dtype=dtype)

    assert kernel_for(t(torch.bfloat16, 8), t(torch.bfloat16, 2), None, True) == "flash"
    assert kernel_for(t(torch.bfloat16, 8, 512), t(torch.bfloat16, 8, 512), None, False) == "efficient"
    assert kernel_for(t(torch.float32, 8), t(torch.float32, 8), None, False) == "efficient"
    assert kernel_for(t(torch.float32, 8), t(torch.float32, 2), None, True) == "math"
    mask = torch.empty(16, 16, device="meta", dtype=torch.bool)
    assert kernel_for(t(torch.bfloat16, 8), t(torch.bfloat16, 8), mask, False) == "efficient"
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        assert kernel_for(t(torch.bfloat16, 8), t(torch.bfloat16, 8), None, False) == "efficient"


def test_caching_allocator_model_places_requests_in_segments_as_cuda_does():
    from megazero.dry_run.caching_allocator import CachingAllocator

    MiB = 1 << 20
    a = CachingAllocator()
    small = [a.malloc(100) for _ in range(4096)]  # 4096 x 512 bytes: one 2 MiB segment
    assert (a.segments, a.reserved) == (1, 2 * MiB)
    a.malloc(1)  # the 4097th block opens a second one
    assert (a.segments, a.reserved) == (2, 4 * MiB)
    mid = [a.malloc(3 * MiB) for _ in range(7)]  # 1-10 MiB: 20 MiB segments, six in one
    assert (a.segments, a.reserved) == (4, 44 * MiB)
    big = a.malloc(11 * MiB + 1)  # best fit: the 17 MiB the 7th request left, split
    assert a.reserved == 44 * MiB and big.segment == mid[6].segment and big.size == 11 * MiB + 512
    huge = a.malloc(31 * MiB + 1)  # >= 10 MiB and nothing cached fits: rounded to 2 MiB
    assert a.reserved == 76 * MiB and huge.size == 32 * MiB  # not split: <= 1 MiB left over
    for block in mid[:3]:  # a segment's three freed neighbours merge
        a.free(block)
    again = a.malloc(9 * MiB)  # and hold a 9 MiB request, the best of 2, 9 and ~6 MiB
    assert a.reserved == 76 * MiB and (again.segment, again.offset) == (mid[0].segment, 0)
    for block in small:
        a.free(block)
    assert (2 * MiB, 0, 0) in a.pools[True]  # the first small segment is whole again, kept
    assert a.peak_reserved == a.reserved == 76 * MiB


def test_rms_norm_on_meta_keeps_what_the_fused_kernel_keeps():
    import torch.nn.functional as F

    rows, h = 4096, 1024
    with DeviceStandIn() as device, device.keeping_activations(), gpu_attention():
        x = torch.empty(rows, h, device="meta", dtype=torch.bfloat16, requires_grad=True)
        w = torch.empty(h, device="meta", dtype=torch.bfloat16, requires_grad=True)
        device.in_setup = False
        out = F.rms_norm(x, (h,), w, 1e-5)
        kept = device.live["activations"]
        out.sum().backward()
    real = F.rms_norm(torch.ones(rows, h, dtype=torch.bfloat16), (h,), torch.ones(h, dtype=torch.bfloat16), 1e-5)
    assert out.shape == real.shape and out.dtype == real.dtype
    assert x.grad.shape == x.shape and w.grad.shape == w.shape
    assert kept == rows * 4  # the fp32 reciprocal RMS per row; the decomposition keeps fp32 copies


MID = [
    "--num-layers",
    "4",
    "--hidden-size",
    "512",
    "--num-attention-heads",
    "8",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--ffn-hidden-size",
    "1408",
    "--swiglu",
    "--normalization",
    "RMSNorm",
    "--position-embedding-type",
    "rope",
    "--disable-bias-linear",
    "--untie-embeddings-and-output-weights",
    "--seq-length",
    "2048",
    "--max-position-embeddings",
    "2048",
    "--attention-dropout",
    "0",
    "--hidden-dropout",
    "0",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "32000",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "8",
    "--train-iters",
    "2",
    "--tensor-model-parallel-size",
    "2",
    "--zero-stage",
    "1",
    "--bf16",
]


def test_planner_predicts_the_dry_runs_peak_on_a_mid_size_layout():
    """A Llama-shaped layer stack (SwiGLU, GQA, RoPE, RMSNorm) at sequence 2048, tp 2 x dp 2: the
    planner's device total within 10% of the dry run's peak (measured: 1.06, the fused loss's
    buffers counted at their most), its model states equal to what the device holds."""
    from megazero.dry_run.job import simulate

    (run,) = simulate(MID, 4, ranks=[0], processes=1)
    assert run.error is None, run.detail
    memory = run.memory
    plan, peak = memory["planner"], memory["peak"]
    assert abs(plan["model_states"] - memory["phases"]["setup"]["allocated"]) <= 1e-3 * plan["model_states"]
    assert 1.0 <= plan["total"] / peak <= 1.1, (plan, peak)


def _cpu_attention_kept(device_type: str, dropout_p: float, dtype) -> int:
    """Bytes of the storages alive after one causal attention's forward (inputs aside): on the
    real CPU, torch's own; on meta, the dry run's simulating the CPU (cpu_kernels)."""
    from megazero.dry_run.gpu_kernels import cpu_kernels

    b, s, heads, d = 1, 128, 2, 16
    saved = {}

    def pack(t):
        saved[id(t.untyped_storage())] = t.untyped_storage()
        return t

    with DeviceStandIn(device="cpu") as device, device.keeping_activations(), cpu_kernels():
        q, k, v = (torch.empty(b, s, heads, d, device=device_type, dtype=dtype, requires_grad=True) for _ in range(3))
        device.in_setup = False
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = core_attention(q, k, v, dropout_p=dropout_p)
    if device_type == "meta":
        return device.live["activations"]
    inputs = {id(t.untyped_storage()) for t in (q, k, v)}
    saved[id(out.untyped_storage())] = out.untyped_storage()
    return sum(st.nbytes() for key, st in saved.items() if key not in inputs)


def test_attention_simulating_the_cpu_keeps_what_the_cpu_keeps():
    """The CPU's SDPA: its flash kernel without dropout (output and log-sum-exp), the math path with
    it (probabilities and the dropout mask); meta keeps what a real CPU tensor's SDPA keeps."""
    for dropout_p, dtype in ((0.0, torch.float32), (0.1, torch.float32), (0.0, torch.bfloat16)):
        real = _cpu_attention_kept("cpu", dropout_p, dtype)
        assert _cpu_attention_kept("meta", dropout_p, dtype) == real, (dropout_p, dtype)
    assert _cpu_attention_kept("cpu", 0.1, torch.float32) > 4 * _cpu_attention_kept("cpu", 0.0, torch.float32)
    with DeviceStandIn(device="cpu") as device:
        torch.empty(1, device="meta")
    assert device.peak == device.process_peak == 4 and device.allocator.segments == 0  # no 512-byte blocks


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_the_optimizer_step_on_a_simulated_gpu_allocates_what_the_fused_kernel_does(grad_dtype):
    """On a GPU adam_step runs torch's fused Adam(W): nothing allocated for fp32 gradients, one
    widened fp32 slice (WIDEN_SLICE elements at most) at a time for 16-bit ones. torch's reference
    ops (meta's own route) would allocate a denominator the size of the partition."""
    from megazero.dry_run.gpu_kernels import gpu_attention
    from megazero.core.errors import UsageError
    from megazero.ops import adam
    from megazero.ops.adam_config import AdamConfig

    n = adam.WIDEN_SLICE + 1000
    with DeviceStandIn(device="cuda") as device, gpu_attention():
        p, m, v = (torch.empty(n, device="meta") for _ in range(3))
        g = torch.empty(n, device="meta", dtype=grad_dtype)
        device.in_setup = False
        before = device.peak
        adam.adam_step([adam.AdamSegment(p, g, m, v, 0.1, None, None)], step=1, lr=1e-3, config=AdamConfig())
        peak = device.peak - before
        # A 16-bit copy of its own is taken (meta pointers are all 0: overlap is told by storage);
        # one sharing a state's storage is still refused.
        copy = torch.empty(n, device="meta", dtype=torch.bfloat16)
        adam.adam_step([adam.AdamSegment(p, g, m, v, 0.1, copy, None)], step=2, lr=1e-3, config=AdamConfig())
        with pytest.raises(UsageError, match="overlaps"):
            adam.adam_step(
                [adam.AdamSegment(p, g, m, v, 0.1, m.view(torch.bfloat16)[:n], None)],
                step=3,
                lr=1e-3,
                config=AdamConfig(),
            )
    widened = 0 if grad_dtype == torch.float32 else adam.WIDEN_SLICE * 4
    assert peak <= widened + 2 * 512, (peak, widened)


def test_gloo_copy_lives_as_long_as_the_async_work_simulating_the_cpu():
    """torch's gloo reduce-scatters a flat copy of its input, which an async op's work holds until it
    is let go after its wait (the comm layer's Handle drops its works then); a sync op's dies with
    the call. Freed at the call's end, the pp 2 ZeRO-2 layout's dry run was 0.88 of its measured peak."""
    from megazero.dry_run.gpu_kernels import _with_gloo_copy

    class Work:
        def wait(self):
            return True

    def fake(output, input, async_op=False):
        return Work() if async_op else None

    collective = _with_gloo_copy(fake, of_output=False)
    with DeviceStandIn(device="cpu") as device:
        out, inp = torch.empty(256, device="meta"), torch.empty(1024, device="meta")
        device.in_setup = False
        held = device.process_live
        assert collective(out, inp) is None and device.process_live == held  # sync: freed
        work = collective(out, inp, async_op=True)
        assert device.process_live == held + 1024 * 4 and work.wait()
        del work
        assert device.process_live == held


SMALL = [
    "--num-layers",
    "2",
    "--hidden-size",
    "256",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "64",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "2",
    "--train-iters",
    "1",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "1000",
    "--zero-stage",
    "1",
    "--bf16",
]
BF16_MOMENTS = ["--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"]


def test_bf16_moments_take_4_bytes_per_parameter_less_in_the_dry_run_and_the_planner():
    """--exp-avg-dtype / --exp-avg-sq-dtype bf16 (Megatron-LM's precision-aware optimizer) at ZeRO-1 over 2
    ranks: the engine's report, the dry run's device (the allocations of set-up) and the planner each
    hold 2 bytes less per moment, 4 per parameter of this rank's partition; nothing else changes."""
    from megazero.dry_run.job import simulate

    fp32, bf16 = (
        simulate(SMALL + extra, 2, ranks=[0], processes=1, stream_check=False, save=False)[0]
        for extra in ([], BF16_MOMENTS)
    )
    assert fp32.error is None and bf16.error is None, (fp32.detail, bf16.detail)
    partition = fp32.model_states["master"] / 4  # the fp32 master: 4 bytes an element
    report = {k: fp32.model_states[k] - bf16.model_states[k] for k in fp32.model_states}
    assert report["optimizer_states"] == report["model_states"] == 4 * partition > 0, report
    setup = fp32.memory["phases"]["setup"]["allocated"] - bf16.memory["phases"]["setup"]["allocated"]
    assert abs(setup - 4 * partition) <= 4 * 512, (setup, partition)  # the allocator's 512-byte blocks
    planned = fp32.memory["planner"]["model_states"] - bf16.memory["planner"]["model_states"]
    assert abs(planned - 4 * partition) <= 1e-6 * partition, (planned, partition)


def test_qgz_adds_nothing_to_the_simulated_gpu_peak():
    """ZeRO-3 over 2 nodes of 2 with and without qgZ (--zero-quantized-gradients) on the simulated GPU:
    the quantized reduction (Triton's kernels: strided rows read in place, codes and scales written
    into the packed send buffer) holds no fp32 or int32 copy of a bucket, so the peak does not grow.
    Before them, a GPU ran the torch reference: 66.3 MiB against 51.2 MiB, this test's failure."""
    from megazero.dry_run.job import simulate

    argv = SMALL[: SMALL.index("--zero-stage")] + [
        "--hidden-size",
        "512",
        "--num-attention-heads",
        "8",
        "--global-batch-size",
        "4",
        "--zero-stage",
        "3",
        "--bf16",
        "--ranks-per-node",
        "2",
    ]
    plain, qgz = (
        simulate(argv + extra, 4, ranks=[0], processes=1, stream_check=False, save=False)[0]
        for extra in ([], ["--zero-quantized-gradients"])
    )
    assert plain.error is None and qgz.error is None, (plain.detail, qgz.detail)
    assert qgz.memory["peak"] <= plain.memory["peak"], (qgz.memory["peak_by_owner"], plain.memory["peak_by_owner"])


def test_quantized_reduction_on_meta_allocates_what_each_simulated_device_runs():
    """qgZ's first hop (strided rows quantized into a packed send buffer, then the reduce into bf16):
    on a simulated GPU the Triton kernels allocate nothing; simulating the CPU, the C++ path's
    staging is counted (each strided row copied before its kernel: at least one row's fp32 copy).
    Planted (cpu_kernels without quantize's route): the CPU's staging went uncounted, this fails."""
    from megazero.dry_run.gpu_kernels import cpu_kernels, gpu_attention
    from megazero.ops.quantize import dequantize_reduce, packed_row_bytes, packed_rows, quantize_rows

    nodes, locals_, chunk, bits, block = 2, 2, 4096, 4, 64
    m = nodes * chunk
    peaks = {}
    for kind, kernels in (("cuda", gpu_attention), ("cpu", cpu_kernels)):
        with DeviceStandIn(device=kind) as device, kernels():
            bucket = torch.empty(nodes * locals_ * chunk, device="meta")
            send = torch.empty(locals_, packed_row_bytes(m, bits, block), dtype=torch.uint8, device="meta")
            out = torch.empty(m, dtype=torch.bfloat16, device="meta")
            device.in_setup = False
            before = device.peak
            packed = packed_rows(send, m, bits, block)
            quantize_rows(bucket.view(nodes, locals_, chunk).transpose(0, 1), packed)
            dequantize_reduce(packed, out=out)
            peaks[kind] = device.peak - before
    assert peaks["cuda"] == 0 and peaks["cpu"] >= 4 * m, peaks


def test_activation_offload_lowers_the_simulated_gpu_peak_by_what_goes_to_the_host():
    """--cpu-offloading over 2 of 4 layers on the simulated GPU, under the stream check: the device's
    activations and its peak fall by the same bytes, which the host holds instead (within 10%: host
    copies are not rounded to the allocator's blocks, and a tensor saved twice is copied once), and
    the planner's fall is within 10% of the dry run's."""
    from megazero.dry_run.job import simulate

    at = SMALL.index("--num-layers")
    argv = SMALL[:at] + ["--num-layers", "4"] + SMALL[at + 2 :]
    plain, offloaded = (
        simulate(argv + extra, 1, ranks=[0], processes=1, stream_check=True, save=False)[0]
        for extra in ([], ["--cpu-offloading", "--cpu-offloading-num-layers", "2"])
    )
    assert plain.error is None and offloaded.error is None, (plain.detail, offloaded.detail)
    before, after = plain.memory, offloaded.memory
    fall = before["peak_by_owner"]["activations"] - after["peak_by_owner"]["activations"]
    assert fall > 0 and before["peak"] - after["peak"] == fall, (before, after)
    assert before["host"]["peak"] == 0 and after["host"]["peak"] == pytest.approx(fall, rel=0.1), after["host"]
    planned = before["planner"]["activations"] - after["planner"]["activations"]
    assert planned == pytest.approx(fall, rel=0.1), (planned, fall)


def _layer_activations(hidden_dropout: float) -> int:
    """Activation bytes one transformer layer keeps after its forward on the simulated GPU."""
    from megazero.models.config import GPTConfig
    from models.gpt import TransformerLayer

    cfg = GPTConfig(
        vocab_size=128,
        hidden_size=256,
        num_layers=1,
        num_attention_heads=4,
        seq_length=512,
        hidden_dropout=hidden_dropout,
        attention_dropout=0.0,
    )
    with DeviceStandIn() as device, device.keeping_activations(), gpu_attention():
        with torch.device("meta"):
            layer = TransformerLayer(cfg, 0).to(torch.bfloat16)
        x = torch.empty(2, cfg.seq_length, cfg.hidden_size, device="meta", dtype=torch.bfloat16, requires_grad=True)
        device.in_setup = False
        with torch.enable_grad():
            out = layer(x)
        kept = device.live["activations"]
        out.sum().backward()
    return kept


def test_dropout_on_a_simulated_gpu_keeps_cudas_one_byte_mask():
    """CUDA's dropout (aten.native_dropout) keeps a bool mask; meta's own keeps noise in the input's
    dtype. A layer at dropout 0.1 keeps exactly its two 1-byte masks (b x s x h each) more than at 0,
    and the planner's mask term says the same. Planted (meta's 2-byte noise): twice the difference."""
    from megazero.config.activation_memory import layer_activation_split
    from megazero.models.config import GPTConfig

    tokens, h = 2 * 512, 256
    assert _layer_activations(0.1) - _layer_activations(0.0) == 2 * tokens * h
    planned = [
        sum(
            layer_activation_split(
                GPTConfig(vocab_size=128, hidden_size=h, num_layers=1, num_attention_heads=4, hidden_dropout=p)
            )
        )
        * h
        * tokens
        for p in (0.1, 0.0)
    ]
    assert planned[0] - planned[1] == 2 * tokens * h
