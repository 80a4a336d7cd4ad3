"""The fused C++ Adam kernel (csrc/cpu_adam*.cpp) against its oracle, and the oracle against torch.

What "equal" means here:
- `adam_update_reference` equals torch.optim.AdamW / Adam bitwise (same ops, same order).
- The kernel equals the reference bitwise in exp_avg and exp_avg_sq. In param it can differ by a few
  ulps, for one reason: torch (built with MKL, as the x86 wheels are) takes sqrt of an fp32 tensor
  from MKL's vector math, which is not correctly rounded (one ulp off in ~20% of elements here);
  the kernel's sqrt is. A one-ulp sqrt difference moves the denominator by up to ~3 roundings and
  the update by up to ~8 ulps of itself in theory; measured over 1.2e8 element-steps the param
  differed by at most 4 ulps of |p_old| + |p_new|. We assert PARAM_ULPS = 8 per step.
- So that nothing else hides under that bound, the kernel is also checked bitwise against the
  reference with only its sqrt swapped for a correctly rounded one (numpy's).
- Every copy of the loop this CPU can run (avx512, avx2, scalar; forced in turn through
  MEGAZERO_CPU_ADAM_ISA) gives the same bits, and the fused bf16/fp16 parameter copy equals the
  updated fp32 parameter rounded by torch's `.to()`.
All of this needs torch's elementwise kernels to fuse multiply-adds as the kernel does (torch's
AVX2/AVX-512 CPU kernels do; its DEFAULT ones, e.g. ATEN_CPU_CAPABILITY=default, do not). Where they
do not, every rounding of lerp/addcmul/add(alpha) differs, Adam amplifies that where exp_avg nearly
cancels, and the comparison falls back to rtol 1e-5, atol UNFUSED_ATOL * max(|old| + |new|).

The kernel tests never skip silently: where megazero._C did not build they FAIL, unless
MEGAZERO_ALLOW_NO_CPP=1 opts out, and then they skip saying why.
"""

import math
import os

import numpy as np
import pytest
import torch

from megazero.core.errors import UsageError
from megazero.ops import adam as adam_module
from megazero.ops.adam import adam_update, adam_update_reference, kernel_available
from megazero.ops.adam_config import AdamConfig

PARAM_ULPS = 8
UNFUSED_ATOL = 1e-6
ALL_ISAS = ("avx512", "avx2", "scalar")
# The CPU flags each copy of the loop needs (Linux /proc/cpuinfo spelling).
ISA_CPU_FLAGS = {
    "avx512": {"avx512f", "avx512bw", "avx512vl", "avx2", "fma", "f16c"},
    "avx2": {"avx2", "fma", "f16c"},
    "scalar": set(),
}


def require_kernel() -> None:
    """Fail (or, with MEGAZERO_ALLOW_NO_CPP=1, skip saying why) when megazero._C is not built."""
    if adam_module._cpp is not None:
        return
    why = f"megazero._C is not built ({adam_module.CPP_IMPORT_ERROR})"
    if os.environ.get("MEGAZERO_ALLOW_NO_CPP") == "1":
        pytest.skip(f"{why}; kernel tests skipped because MEGAZERO_ALLOW_NO_CPP=1")
    pytest.fail(
        f"{why}: rebuild with `pip install --no-deps -e .` (needs a C++ compiler), or set "
        f"MEGAZERO_ALLOW_NO_CPP=1 to skip the kernel tests",
        pytrace=False,
    )


@pytest.fixture
def kernel_on(monkeypatch):
    require_kernel()
    monkeypatch.delenv("MEGAZERO_DISABLE_CPP_ADAM", raising=False)
    monkeypatch.delenv(adam_module.ISA_ENV, raising=False)
    assert kernel_available()


def supported_isas() -> list:
    return list(adam_module._cpp.supported_isas())


def _torch_fuses_multiply_add() -> bool:
    """Whether torch's lerp_ rounds w*(g-m)+m once, as an fma (compared with an fp64 emulation)."""
    gen = torch.Generator().manual_seed(0)
    m, g = torch.randn(4096, generator=gen), torch.randn(4096, generator=gen)
    w = torch.tensor(0.1, dtype=torch.float32)
    fused = (w.double() * (g - m).double() + m.double()).float()
    return torch.equal(m.clone().lerp_(g, 0.1), fused)


FUSED = _torch_fuses_multiply_add()


def run_kernel(monkeypatch, isa, param, grad, exp_avg, exp_avg_sq, **kwargs):
    """adam_update on the kernel path, with the loop copy `isa` forced."""
    assert adam_module._kernel_accepts(param, grad, exp_avg, exp_avg_sq)
    monkeypatch.setenv(adam_module.ISA_ENV, isa)
    adam_update(param, grad, exp_avg, exp_avg_sq, **kwargs)


def reference_with_exact_sqrt(param, grad, exp_avg, exp_avg_sq, **kwargs):
    """adam_update_reference with sqrt from numpy (correctly rounded) instead of torch's."""
    adam_update_reference(
        param, grad, exp_avg, exp_avg_sq, sqrt=lambda t: torch.from_numpy(np.sqrt(t.numpy())), **kwargs
    )


def assert_within_ulps(actual, expected, before, ulps=PARAM_ULPS):
    """|actual - expected| <= ulps * ulp(|before| + |expected|); NaN and inf must match exactly.
    The scale includes |before| because when the old value and the update nearly cancel, the new
    value is tiny and the update's own rounding, not the new value's, sets the error."""
    nan, inf = torch.isnan(expected), torch.isinf(expected)
    assert torch.equal(torch.isnan(actual), nan)
    assert torch.equal(actual[inf], expected[inf])
    scale = before.abs() + expected.abs()
    ulp = torch.nextafter(scale, torch.tensor(math.inf)) - scale
    err = (actual - expected).abs()
    worst = torch.where(nan | inf, 0.0, err / ulp).max().item() if err.numel() else 0.0
    assert worst <= ulps, f"param differs by {worst} ulps of |p_old| + |p_new| (bound {ulps})"


def assert_bitwise(actual, expected):
    """Same bits, except that any NaN equals any NaN (payloads are not part of the contract)."""
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(actual), nan)
    bits = {4: torch.int32, 2: torch.int16}[actual.element_size()]
    actual, expected = actual.view(bits), expected.view(bits)
    if nan.any():
        actual, expected = actual.masked_fill(nan, 0), expected.masked_fill(nan, 0)
    assert torch.equal(actual, expected)


def assert_state_matches(kernel, reference, before):
    """(param, exp_avg, exp_avg_sq) after one step: the contract in the module docstring. Where
    torch does not fuse multiply-adds, the moments get the same ulp bound as param."""
    for name, k, r, b in zip(("param", "exp_avg", "exp_avg_sq"), kernel, reference, before):
        if not FUSED:
            scale = (b.abs() + r.abs())[torch.isfinite(r)].max()
            torch.testing.assert_close(k, r, rtol=1e-5, atol=UNFUSED_ATOL * scale, equal_nan=True)
        elif name == "param":
            assert_within_ulps(k, r, b)
        else:
            assert_bitwise(k, r)


def make_grad(n, dtype, gen):
    """Gradients spanning six decades, so subnormal-ish and large values both appear."""
    magnitude = 10.0 ** torch.randint(-4, 2, (n,), generator=gen).float()
    return (torch.randn(n, generator=gen) * magnitude).to(dtype)


COPY_DTYPES = (None, torch.bfloat16, torch.float16)


def check_steps(monkeypatch, n, grad_dtype, config, weight_decay, grad_scale, steps, seed=0):
    """Every supported loop copy against the references, one step at a time (each step starts
    all sides from the same state, so errors cannot compound). Step k writes the parameter copy
    in COPY_DTYPES[k % 3], so three steps cover no copy, bf16 and fp16."""
    gen = torch.Generator().manual_seed(seed)
    param = torch.randn(n, generator=gen)
    exp_avg, exp_avg_sq = torch.zeros(n), torch.zeros(n)
    for step in range(1, steps + 1):
        grad = make_grad(n, grad_dtype, gen)
        copy_dtype = COPY_DTYPES[step % 3]
        kw = dict(step=step, lr=config.lr, config=config, weight_decay=weight_decay, grad_scale=grad_scale)
        before = [t.clone() for t in (param, exp_avg, exp_avg_sq)]
        exact = [t.clone() for t in before]
        adam_update_reference(param, grad, exp_avg, exp_avg_sq, **kw)
        if FUSED:
            reference_with_exact_sqrt(exact[0], grad, exact[1], exact[2], **kw)
        first_isa = None
        for isa in supported_isas():
            kernel = [t.clone() for t in before]
            copy = None if copy_dtype is None else torch.full((n,), 7, dtype=copy_dtype)
            run_kernel(monkeypatch, isa, kernel[0], grad, kernel[1], kernel[2], param_copy=copy, **kw)
            assert_state_matches(kernel, (param, exp_avg, exp_avg_sq), before)
            for k, e in zip(kernel, exact if FUSED else first_isa or kernel):
                assert_bitwise(k, e)
            if copy is not None:
                assert_bitwise(copy, kernel[0].to(copy_dtype))
            first_isa = first_isa or kernel


# --- the oracle against torch ---------------------------------------------------------------
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam_l2"])
def test_reference_matches_torch_optim_bitwise(decoupled):
    torch.manual_seed(0)
    config = AdamConfig(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, decoupled_weight_decay=decoupled)
    params = [torch.randn(1000, requires_grad=True), torch.randn(37, requires_grad=True)]
    optim_cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    optim = optim_cls(
        params,
        lr=config.lr,
        betas=(config.beta1, config.beta2),
        eps=config.eps,
        weight_decay=config.weight_decay,
        foreach=False,
    )
    ours = [p.detach().clone() for p in params]
    states = [(torch.zeros_like(p), torch.zeros_like(p)) for p in ours]
    for step in range(1, 6):
        grads = [torch.randn_like(p) for p in ours]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        optim.step()
        for p, g, (m, v) in zip(ours, grads, states):
            adam_update_reference(p, g, m, v, step=step, lr=config.lr, config=config, weight_decay=config.weight_decay)
        for p_torch, p_ours in zip(params, ours):
            assert torch.equal(p_torch.detach(), p_ours)
        for p_torch, (m, v) in zip(params, states):
            assert torch.equal(optim.state[p_torch]["exp_avg"], m)
            assert torch.equal(optim.state[p_torch]["exp_avg_sq"], v)


# --- the kernel against the oracle ----------------------------------------------------------
@pytest.mark.parametrize("n", [1, 7, 15, 16, 17, 1023, 1_000_003])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam_l2"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1], ids=["wd0", "wd"])
def test_kernel_matches_reference(kernel_on, monkeypatch, n, grad_dtype, decoupled, weight_decay):
    """Sizes cover every SIMD tail: below, at and just past 8 and 16 lanes, and long buffers."""
    config = AdamConfig(lr=1e-3, decoupled_weight_decay=decoupled)
    steps = 3 if n > 10_000 else 6
    grad_scale = 1.0 if n == 17 else 0.37  # 17: the no-scaling path; elsewhere unscale/clip
    check_steps(monkeypatch, n, grad_dtype, config, weight_decay, grad_scale, steps)


@pytest.mark.parametrize("beta1", [0.3, 0.5, 0.0], ids=["b1=0.3", "b1=0.5", "b1=0"])
def test_kernel_takes_torchs_other_lerp_branch(kernel_on, monkeypatch, beta1):
    """1 - beta1 >= 0.5 makes torch's lerp start from the grad instead of exp_avg."""
    config = AdamConfig(lr=1e-2, beta1=beta1, beta2=0.95, eps=1e-6)
    check_steps(monkeypatch, 4099, torch.float32, config, 0.05, 2.0, steps=3)


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_every_16_bit_grad_pattern(kernel_on, monkeypatch, grad_dtype):
    """All 65,536 encodings (subnormals, inf, NaN included) widen exactly as torch widens them."""
    grad = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(grad_dtype)
    n = grad.numel()
    config = AdamConfig(lr=1e-3)
    param = torch.linspace(-1, 1, n)
    reference = [param.clone(), torch.zeros(n), torch.zeros(n)]
    kw = dict(step=1, lr=config.lr, config=config, weight_decay=0.0, grad_scale=1.0)
    adam_update_reference(reference[0], grad, reference[1], reference[2], **kw)
    for isa in supported_isas():
        kernel = [param.clone(), torch.zeros(n), torch.zeros(n)]
        run_kernel(monkeypatch, isa, kernel[0], grad, kernel[1], kernel[2], **kw)
        # exp_avg = 0.1 * grad here, so it shows every widened value
        assert_state_matches(kernel, reference, (param, torch.zeros(n), torch.zeros(n)))


def special_floats(gen) -> torch.Tensor:
    """Random fp32 bit patterns (every exponent, NaNs and subnormals included) and the values
    where rounding to bf16/fp16 is decided: ties to even, fp16's overflow and subnormal edges."""
    random_bits = torch.randint(-(2**31), 2**31, (300_001,), generator=gen, dtype=torch.int64)
    ties = torch.tensor([0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001], dtype=torch.int64)  # bf16
    edges = torch.tensor(
        [
            65504.0,
            65519.99,
            65520.0,
            65536.0,
            2.0**-14,
            2.0**-24,
            2.0**-25,
            1.5 * 2.0**-25,
            2.0**-26,
            1.0 + 2.0**-11,
            1.0 + 3 * 2.0**-11,
            math.inf,
            -math.inf,
            0.0,
            -0.0,
            3.4e38,
            -3.4e38,
        ]
    )
    bits = torch.cat([random_bits, ties]).to(torch.int32).view(torch.float32)
    return torch.cat([bits, edges, -edges])


@pytest.mark.parametrize("copy_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_param_copy_rounds_like_torch(kernel_on, monkeypatch, copy_dtype):
    """lr 0 and a zero gradient leave param as it was, so the copy shows the conversion alone
    on every kind of fp32 value, through every loop copy (and its masked or scalar tail)."""
    param = special_floats(torch.Generator().manual_seed(5))
    n = param.numel()
    expected = param.to(copy_dtype)
    for isa in supported_isas():
        state = [param.clone(), torch.zeros(n), torch.zeros(n)]
        copy = torch.empty(n, dtype=copy_dtype)
        run_kernel(
            monkeypatch,
            isa,
            state[0],
            torch.zeros(n),
            state[1],
            state[2],
            param_copy=copy,
            step=1,
            lr=0.0,
            config=AdamConfig(),
            weight_decay=0.0,
        )
        assert_bitwise(state[0], param)
        assert_bitwise(copy, expected)


def test_kernel_tracks_reference_over_many_steps(kernel_on, monkeypatch):
    """Without re-syncing, the few-ulp differences stay at the level the exactness tests allow between
    parallel layouts (rtol 1e-5), and far below it in practice."""
    gen = torch.Generator().manual_seed(1)
    n = 100_003
    for decoupled in (True, False):
        config = AdamConfig(lr=1e-2, decoupled_weight_decay=decoupled)
        kernel = [torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)]
        reference = [t.clone() for t in kernel]
        for step in range(1, 31):
            grad = make_grad(n, torch.bfloat16, gen)
            kw = dict(step=step, lr=config.lr, config=config, weight_decay=0.1, grad_scale=0.25)
            adam_update(kernel[0], grad, kernel[1], kernel[2], **kw)
            adam_update_reference(reference[0], grad, reference[1], reference[2], **kw)
        for k, r in zip(kernel, reference):
            torch.testing.assert_close(k, r, rtol=1e-5, atol=1e-7 * r.abs().max().item())


def test_threads_do_not_change_results(kernel_on):
    """OpenMP splits the buffer into blocks; an elementwise update must not notice."""
    gen = torch.Generator().manual_seed(3)
    n = 1_000_003
    grad = make_grad(n, torch.bfloat16, gen)
    start = [
        torch.randn(n, generator=gen),
        torch.randn(n, generator=gen).mul_(1e-2),
        torch.rand(n, generator=gen).mul_(1e-4),
    ]
    results, threads_before = [], torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            state = [t.clone() for t in start]
            copy = torch.empty(n, dtype=torch.bfloat16)
            adam_update(
                state[0],
                grad,
                state[1],
                state[2],
                step=7,
                lr=1e-3,
                config=AdamConfig(),
                weight_decay=0.1,
                grad_scale=0.5,
                param_copy=copy,
            )
            results.append(state + [copy])
    finally:
        torch.set_num_threads(threads_before)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


# --- which paths exist, and how they are chosen ---------------------------------------------
def _cpu_flags() -> set:
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


@pytest.mark.parametrize("isa", ALL_ISAS)
def test_loop_copy_runs_where_the_cpu_has_it(isa):
    """Each loop copy is compiled into the build and offered exactly where the CPU has its
    instructions, so a build that lost the AVX-512 path fails here rather than running slower.
    A copy this CPU lacks is skipped with that reason (the parity tests run all the others)."""
    require_kernel()
    if not os.path.exists("/proc/cpuinfo"):
        pytest.skip("no /proc/cpuinfo to read this CPU's flags from")
    if not any(machine in os.uname().machine for machine in ("x86_64", "i686", "i386")):
        assert adam_module._cpp.supported_isas() == ["scalar"]
        pytest.skip(f"{isa}: not an x86 CPU; only the scalar loop exists here")
    assert isa in adam_module._cpp.compiled_isas()
    missing = ISA_CPU_FLAGS[isa] - _cpu_flags()
    if missing:
        assert isa not in supported_isas()
        pytest.skip(f"this CPU lacks {isa} ({', '.join(sorted(missing))}); its loop is not run here")
    assert isa in supported_isas()
    assert adam_module._cpp.kernel_isa() == supported_isas()[0]


def test_forcing_a_loop_copy(kernel_on, monkeypatch):
    """MEGAZERO_CPU_ADAM_ISA reaches the kernel, which reports the copy it ran; a name this CPU
    cannot run is a one-line UsageError listing those it can."""
    n = 33
    tensors = [torch.ones(n) for _ in range(4)]
    ptrs = [t.data_ptr() for t in tensors]
    for isa in supported_isas():
        assert adam_module._cpp.adam_update(*ptrs, n, 0, 1, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, 1.0, 1, isa=isa) == isa
        monkeypatch.setenv(adam_module.ISA_ENV, isa)
        assert adam_module.kernel_info()["isa"] == isa
    monkeypatch.setenv(adam_module.ISA_ENV, "avx9000")
    with pytest.raises(UsageError, match="MEGAZERO_CPU_ADAM_ISA=avx9000 .* use one of .*scalar"):
        adam_update(*tensors, step=1, lr=1e-3, config=AdamConfig(), weight_decay=0.0)


def test_missing_extension_fails_unless_opted_out(monkeypatch):
    """The rule the kernel tests follow when megazero._C is absent: fail, or skip if asked to."""
    monkeypatch.setattr(adam_module, "_cpp", None)
    monkeypatch.delenv("MEGAZERO_ALLOW_NO_CPP", raising=False)
    with pytest.raises(pytest.fail.Exception, match="not built.*MEGAZERO_ALLOW_NO_CPP=1"):
        require_kernel()
    monkeypatch.setenv("MEGAZERO_ALLOW_NO_CPP", "1")
    with pytest.raises(pytest.skip.Exception, match="skipped because MEGAZERO_ALLOW_NO_CPP=1"):
        require_kernel()


class _RecordingKernel:
    def __init__(self):
        self.calls = []

    def adam_update(self, *args):
        self.calls.append(args)

    def supported_isas(self):
        return ["scalar"]


def _routed_to_kernel(monkeypatch, param, grad, exp_avg, exp_avg_sq, param_copy=None):
    """Whether adam_update called the kernel; if it did, the copy pointer it passed (0: none)."""
    fake = _RecordingKernel()
    monkeypatch.setattr(adam_module, "_cpp", fake)
    adam_update(
        param, grad, exp_avg, exp_avg_sq, step=1, lr=1e-3, config=AdamConfig(), weight_decay=0.0, param_copy=param_copy
    )
    return (len(fake.calls) == 1), (fake.calls[0][15] if fake.calls else None)


def test_adam_update_routing(monkeypatch):
    monkeypatch.delenv("MEGAZERO_DISABLE_CPP_ADAM", raising=False)
    monkeypatch.delenv(adam_module.ISA_ENV, raising=False)
    n = 64
    fresh = lambda: (torch.zeros(n), torch.zeros(n), torch.zeros(n))  # noqa: E731
    p, m, v = fresh()
    assert _routed_to_kernel(monkeypatch, p, torch.ones(n, dtype=torch.bfloat16), m, v)[0]
    p, m, v = fresh()
    assert not _routed_to_kernel(monkeypatch, p, torch.ones(2 * n)[::2], m, v)[0]  # strided grad
    p, m, v = fresh()
    assert not _routed_to_kernel(monkeypatch, p, torch.ones(n, dtype=torch.float64), m, v)[0]
    p, m, v = fresh()
    with torch.no_grad():  # how optimizers step leaf params
        assert _routed_to_kernel(monkeypatch, p.requires_grad_(), torch.ones(n), m, v)[0]
    with pytest.raises(RuntimeError, match="leaf Variable"):  # autograd still guards the rest
        _routed_to_kernel(monkeypatch, p, torch.ones(n), m, v)
    # A 16-bit contiguous copy is written by the kernel; any other is copied afterwards.
    p, m, v = fresh()
    copy = torch.full((n,), 5.0, dtype=torch.bfloat16)
    assert _routed_to_kernel(monkeypatch, p, torch.ones(n), m, v, copy) == (True, copy.data_ptr())
    for copy in (torch.full((n,), 5.0), torch.full((2 * n,), 5.0, dtype=torch.float16)[::2]):
        p, m, v = fresh()
        assert _routed_to_kernel(monkeypatch, p.fill_(0.25), torch.ones(n), m, v, copy) == (True, 0)
        assert torch.equal(copy, p.to(copy.dtype))  # the fake kernel left p as it was
    monkeypatch.setenv("MEGAZERO_DISABLE_CPP_ADAM", "1")
    p, m, v = fresh()
    assert not _routed_to_kernel(monkeypatch, p, torch.ones(n), m, v)[0]
    assert not kernel_available()


def test_param_copy_on_the_reference_path_and_bad_copies(monkeypatch):
    monkeypatch.setenv("MEGAZERO_DISABLE_CPP_ADAM", "1")
    gen = torch.Generator().manual_seed(4)
    n = 101
    param, grad = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    kw = dict(step=1, lr=1e-2, config=AdamConfig(), weight_decay=0.1)
    copy = torch.empty(n, dtype=torch.float16)
    adam_update(param, grad, torch.zeros(n), torch.zeros(n), param_copy=copy, **kw)
    assert torch.equal(copy, param.to(torch.float16))
    with pytest.raises(UsageError, match="param_copy has 100 elements and param 101"):
        adam_update(param, grad, torch.zeros(n), torch.zeros(n), param_copy=copy[:100], **kw)
    flat = torch.zeros(3 * n)
    with pytest.raises(UsageError, match="param_copy overlaps"):
        adam_update(flat[:n], grad, flat[n : 2 * n], flat[2 * n :], param_copy=flat[n // 2 :][:n], **kw)
