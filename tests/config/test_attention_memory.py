"""The start-up memory check's attention term against what the CPU's attention kernels really allocate:
the allocator's own events (torch.profiler's memory profile: every allocation and free of the CPU
allocator, kernels' internal buffers included) over one attention's forward and backward, against
config/attention_memory.py's kept and peak bytes; the kernel the check assumes against torch's own
pick; and a run whose only large term is that kernel's refused at start-up (tests/run/test_user_errors.py
holds the one-line refusal), while the same flags with the flash kernel are accepted. Packed documents
(--reset-attention-mask): the per-document calls keep no more than the planner counts for the kernel
over the whole sequence.

Mutation planted and seen failing (by hand, then reverted): the CPU's per-document path replaced by
one SDPA call with the documents' dense (s x s) mask -> the packed-documents check fails (the square
is kept); the per-document calls not recomputed in the backward (their outputs and log-sum-exps kept
beside the concatenation) -> it fails (kept 139264 bytes, the whole-sequence call's 73728).
"""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from megazero.config.attention_memory import kernel_for, math_kernel_bytes
from megazero.config.memory_estimate import estimate
from megazero.config.train_flags import config_from_args, parse_args
from megazero.models.attention import attention_kernel, core_attention


def _allocated(b, s, heads, groups, d, dropout, dtype, documents=None):
    """(bytes live after the forward, peak bytes live) of core_attention's forward and backward,
    counted from the CPU allocator's events; the inputs and the output gradient are made before."""
    torch.manual_seed(0)
    q = torch.randn(b, s, heads, d, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(b, s, groups, d, dtype=dtype, requires_grad=True) for _ in "kv")
    grad = torch.randn(b, s, heads * d, dtype=dtype)
    marker = 12345  # a first allocation of its own size marks the forward's end
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = core_attention(q, k, v, dropout, documents=documents)
        torch.empty(marker, dtype=torch.uint8)
        out.backward(grad)
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns()
    )
    live = peak = 0
    kept = None
    for event in events:
        if kept is None and event.nbytes() == marker:
            kept = live
        live += event.nbytes()
        peak = max(peak, live)
    return kept, peak


@pytest.mark.parametrize(
    "b,s,heads,groups,d,dtype",
    [
        (1, 1024, 2, 2, 8, torch.float32),
        (2, 768, 1, 1, 8, torch.float32),
        (1, 1024, 2, 1, 8, torch.float32),
        (1, 1024, 2, 2, 8, torch.bfloat16),
    ],
)
def test_math_kernel_bytes_are_what_the_cpu_allocates(b, s, heads, groups, d, dtype):
    weight_bytes = torch.finfo(dtype).bits // 8
    assert attention_kernel("cpu", dtype, heads, groups, d, 0.1) == "math"
    kept, peak = _allocated(b, s, heads, groups, d, 0.1, dtype)
    want_kept, want_peak = math_kernel_bytes(b, heads, s, weight_bytes)
    # the rest is O(s): q, k, v, out and their gradients, a few percent at these lengths
    assert kept == pytest.approx(want_kept, rel=0.05), (kept, want_kept)
    assert peak == pytest.approx(want_peak, rel=0.05), (peak, want_peak)


def test_without_dropout_the_cpu_runs_flash_which_keeps_no_square():
    assert attention_kernel("cpu", torch.float32, 2, 2, 8, 0.0) == "flash"
    _, peak = _allocated(1, 1024, 2, 2, 8, 0.0, torch.float32)
    assert peak < 0.1 * math_kernel_bytes(1, 2, 1024, 4)[1], peak


LONG = [
    "--seq-length",
    "400000",
    "--max-position-embeddings",
    "400000",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "1",
    "--recompute-granularity",
    "full",
    "--recompute-method",
    "uniform",
    "--recompute-num-layers",
    "1",
]


def test_the_check_counts_the_kernel_the_device_runs():
    math_run = config_from_args(parse_args(LONG), 1)
    flash_run = config_from_args(parse_args(LONG + ["--attention-dropout", "0"]), 1)
    assert kernel_for(math_run, "cpu") == "math" and kernel_for(flash_run, "cpu") == "flash"
    found = estimate(math_run, 1, "cpu")
    heads = math_run.model.num_attention_heads
    assert found.attention == pytest.approx(math_kernel_bytes(1, heads, 400000, 4)[1])
    assert estimate(flash_run, 1, "cpu").attention == 0
    assert estimate(flash_run, 1, "cpu").total < 16 * 2**30  # accepted on a machine of this size
    # a normal run with dropout still counts the kernel, and fits
    normal = estimate(config_from_args(parse_args([]), 1), 1, "cpu")
    assert 0 < normal.attention and normal.total < 8 * 2**30


def test_packed_documents_keep_what_one_call_over_the_sequence_keeps():
    """The CPU's per-document path: flash (no dropout) keeps no (s x s) square and no more than the
    unmasked call (its output once);
    the math kernel (dropout) per document keeps at most the whole sequence's square, which is what
    the planner counts (config/activation_memory.py's document_bytes adds only the step's tensors)."""
    from megazero.models.documents import DocumentMasking, pack_documents

    s, eod = 1024, 1
    tokens = torch.randint(2, 50, (1, s), generator=torch.Generator().manual_seed(0))
    tokens[0, [99, 150, 530, 531, 900]] = eod  # documents of 100 to 380 tokens, one of 1
    documents, _ = pack_documents(tokens, DocumentMasking(eod, True, True, True))
    assert len(documents.bounds) == 7
    kept, peak = _allocated(1, s, 2, 2, 8, 0.0, torch.float32, documents)
    assert peak < 0.1 * math_kernel_bytes(1, 2, s, 4)[1], peak
    whole_kept, _ = _allocated(1, s, 2, 2, 8, 0.0, torch.float32)
    assert kept <= whole_kept, (kept, whole_kept)  # no second copy of the output
    kept, peak = _allocated(1, s, 2, 2, 8, 0.1, torch.float32, documents)
    want_kept, want_peak = math_kernel_bytes(1, 2, s, 4)
    assert kept <= want_kept and peak <= want_peak, (kept, want_kept, peak, want_peak)
