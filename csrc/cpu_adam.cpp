// megazero._C: the fused CPU Adam(W) step for flat fp32 ZeRO partitions.
//
// This file owns one kernel, `adam_update`, and the pybind11 module `megazero._C` that exposes it.
// It does not own the optimizer's policy (when to step, which segments get weight decay, loss
// scaling): megazero/zero/adam.py decides that, checks every tensor, and passes raw pointers
// (`tensor.data_ptr()`), so this file needs no libtorch headers and builds in seconds.
//
// Numerics. The oracle is `adam_update_reference` in megazero/zero/adam.py, i.e. the sequence of
// torch ops torch.optim.AdamW runs. Each of those ops rounds to fp32 once per element, and torch's
// AVX2/AVX-512 CPU kernels fuse three of them into a single fma:
//   lerp_(g, w)             -> fma(w, g - m, m)        when |w| < 0.5
//                              fma(w - 1, g - m, g)    otherwise
//   addcmul_(g, g, value=c) -> fma(c * g, g, v)
//   add(p, alpha=wd)        -> fma(p, wd, g)
// The loop below repeats those steps one for one, in the same order, with scalars rounded to fp32
// the way torch rounds a Python float. That requires building with -ffp-contract=off (setup.py
// does): otherwise the compiler could fuse `p * decay` into the final add, which torch does not.
// Result: exp_avg and exp_avg_sq are bitwise equal to the reference. param is too, except where
// torch's sqrt is not correctly rounded: torch builds with MKL (the x86 wheels) take fp32 sqrt
// from MKL's vector math, one ulp off for ~20% of inputs, while std::sqrt is exact. param then
// differs by a few ulps (tests/test_cpu_adam.py states the bound and checks bitwise equality
// against the reference with a correctly rounded sqrt). torch's DEFAULT-capability (non-AVX2)
// kernels fuse nothing; against those every fma step differs by one rounding.
#include <pybind11/pybind11.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace py = pybind11;

namespace {

// Grad dtype codes; megazero/zero/adam.py holds the same table.
enum GradDtype : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// Below this many elements per thread, waking threads costs more than the loop itself.
constexpr int64_t kMinElementsPerThread = 1 << 16;

inline float float_from_bits(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

inline uint32_t bits_from_float(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

// bf16 is the top half of an fp32, so widening is exact: shift the bits back up.
inline float load_grad(const uint16_t* grad, int64_t i, std::integral_constant<int, kBFloat16>) {
  return float_from_bits(static_cast<uint32_t>(grad[i]) << 16);
}

// IEEE half -> float, exact for every input. Written with integer selects rather than branches so
// the loop still vectorises, and without fp32 subnormal intermediates so it stays right when a
// library has turned on flush-to-zero / denormals-are-zero.
inline float load_grad(const uint16_t* grad, int64_t i, std::integral_constant<int, kFloat16>) {
  const uint32_t half = grad[i];
  const uint32_t sign = (half & 0x8000u) << 16;
  const uint32_t exponent = (half >> 10) & 0x1fu;
  const uint32_t mantissa = half & 0x3ffu;
  // Normal: move the exponent from bias 15 to bias 127 and the mantissa to the top of 23 bits.
  const uint32_t normal = ((exponent + (127u - 15u)) << 23) | (mantissa << 13);
  // Subnormal or zero: the value is mantissa * 2^-24, a normal fp32 (or 0), computed exactly.
  const uint32_t tiny = bits_from_float(static_cast<float>(mantissa) * 0x1p-24f);
  // Inf or NaN: keep the payload and set the quiet bit on NaNs, as the F16C instruction does.
  const uint32_t quiet = mantissa != 0 ? 0x00400000u : 0u;
  const uint32_t special = 0x7f800000u | quiet | (mantissa << 13);
  const uint32_t magnitude = exponent == 0x1fu ? special : (exponent == 0 ? tiny : normal);
  return float_from_bits(sign | magnitude);
}

inline float load_grad(const float* grad, int64_t i, std::integral_constant<int, kFloat32>) {
  return grad[i];
}

// Every per-step constant, already rounded to fp32 exactly where torch rounds it.
struct StepScalars {
  float grad_scale;      // grad.float().mul_(grad_scale)
  float decay;           // param.mul_(1 - lr * wd)            (AdamW only)
  float l2;              // grad.add(param, alpha=wd)          (Adam only)
  float lerp_coeff;      // 1 - beta1, or (1 - beta1) - 1 when torch's lerp takes its other branch
  bool lerp_from_grad;   // that other branch: start from g rather than m
  float beta2;           // exp_avg_sq.mul_(beta2)
  float one_minus_beta2; // addcmul_(value=1 - beta2)
  float bias2_sqrt;      // .div_(sqrt(1 - beta2^step))
  float eps;             // .add_(eps)
  float neg_step_size;   // addcdiv_(value=-lr / (1 - beta1^step))
  bool decoupled;
  bool has_weight_decay;
};

StepScalars make_scalars(int64_t step, double lr, double beta1, double beta2, double eps,
                         double weight_decay, bool decoupled, double grad_scale) {
  // Python computes these in double and torch casts each to fp32 when it meets an fp32 tensor;
  // pow comes from the same libm Python's `**` calls, so the doubles agree to the last bit.
  StepScalars s{};
  s.grad_scale = static_cast<float>(grad_scale);
  s.has_weight_decay = weight_decay != 0.0;
  s.decoupled = decoupled;
  s.decay = static_cast<float>(1.0 - lr * weight_decay);
  s.l2 = static_cast<float>(weight_decay);
  const float weight = static_cast<float>(1.0 - beta1);
  s.lerp_from_grad = !(std::fabs(weight) < 0.5f);
  s.lerp_coeff = s.lerp_from_grad ? weight - 1.0f : weight;
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  const double step_d = static_cast<double>(step);
  // pow(x, 0.5), not sqrt(x): torch's AdamW writes `bias_correction2 ** 0.5`.
  s.bias2_sqrt = static_cast<float>(std::pow(1.0 - std::pow(beta2, step_d), 0.5));
  s.eps = static_cast<float>(eps);
  s.neg_step_size = static_cast<float>(-(lr / (1.0 - std::pow(beta1, step_d))));
  return s;
}

// The whole step for elements [begin, end), one pass over memory. `Decoupled`/`WeightDecay` are
// template flags so the loop body has no mode branches and the compiler can vectorise it.
template <int Dtype, bool WeightDecay, bool Decoupled, typename GradT>
__attribute__((always_inline)) inline void update_range(
    float* __restrict__ param, const GradT* __restrict__ grad, float* __restrict__ exp_avg,
    float* __restrict__ exp_avg_sq, int64_t begin, int64_t end, const StepScalars& s) {
  const std::integral_constant<int, Dtype> dtype;
  for (int64_t i = begin; i < end; ++i) {
    float g = load_grad(grad, i, dtype) * s.grad_scale;
    float p = param[i];
    if (WeightDecay && Decoupled) p = p * s.decay;
    if (WeightDecay && !Decoupled) g = std::fma(p, s.l2, g);
    const float m_old = exp_avg[i];
    const float m = std::fma(s.lerp_coeff, g - m_old, s.lerp_from_grad ? g : m_old);
    const float v = std::fma(s.one_minus_beta2 * g, g, exp_avg_sq[i] * s.beta2);
    const float denom = std::sqrt(v) / s.bias2_sqrt + s.eps;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    param[i] = p + (s.neg_step_size * m) / denom;
  }
}

template <int Dtype, typename GradT>
__attribute__((always_inline)) inline void dispatch_modes(
    float* param, const GradT* grad, float* exp_avg, float* exp_avg_sq,
    int64_t begin, int64_t end, const StepScalars& s) {
  if (!s.has_weight_decay)
    update_range<Dtype, false, false>(param, grad, exp_avg, exp_avg_sq, begin, end, s);
  else if (s.decoupled)
    update_range<Dtype, true, true>(param, grad, exp_avg, exp_avg_sq, begin, end, s);
  else
    update_range<Dtype, true, false>(param, grad, exp_avg, exp_avg_sq, begin, end, s);
}

__attribute__((always_inline)) inline void dispatch_dtype(
    float* param, const void* grad, int grad_dtype, float* exp_avg, float* exp_avg_sq,
    int64_t begin, int64_t end, const StepScalars& s) {
  switch (grad_dtype) {
    case kFloat32:
      dispatch_modes<kFloat32>(param, static_cast<const float*>(grad), exp_avg, exp_avg_sq, begin, end, s);
      break;
    case kBFloat16:
      dispatch_modes<kBFloat16>(param, static_cast<const uint16_t*>(grad), exp_avg, exp_avg_sq, begin, end, s);
      break;
    default:
      dispatch_modes<kFloat16>(param, static_cast<const uint16_t*>(grad), exp_avg, exp_avg_sq, begin, end, s);
      break;
  }
}

// One copy of the loop per instruction set. The default build targets baseline x86-64 (cluster
// images run on many CPU generations), where std::fma is a correct but slow libm call (~8x slower
// loop); every x86 server since 2013 has AVX2+FMA, so that copy is compiled too and picked at run
// time. A build whose flags already enable AVX2+FMA (MEGAZERO_NATIVE=1) needs only the first copy.
void range_build_target(float* param, const void* grad, int grad_dtype, float* exp_avg,
                        float* exp_avg_sq, int64_t begin, int64_t end, const StepScalars& s) {
  dispatch_dtype(param, grad, grad_dtype, exp_avg, exp_avg_sq, begin, end, s);
}

#if defined(__x86_64__) && defined(__GNUC__) && !(defined(__AVX2__) && defined(__FMA__))
#define MEGAZERO_HAVE_AVX2_COPY 1
__attribute__((target("avx2,fma,f16c")))
void range_avx2(float* param, const void* grad, int grad_dtype, float* exp_avg,
                float* exp_avg_sq, int64_t begin, int64_t end, const StepScalars& s) {
  dispatch_dtype(param, grad, grad_dtype, exp_avg, exp_avg_sq, begin, end, s);
}
#endif

using RangeFn = void (*)(float*, const void*, int, float*, float*, int64_t, int64_t, const StepScalars&);

struct Isa {
  RangeFn fn;
  const char* name;
};

Isa select_isa() {
#ifdef MEGAZERO_HAVE_AVX2_COPY
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    return {range_avx2, "avx2+fma"};
#endif
  return {range_build_target, "build target"};
}

const Isa& isa() {
  static const Isa chosen = select_isa();
  return chosen;
}

void adam_update(uintptr_t param_ptr, uintptr_t grad_ptr, uintptr_t exp_avg_ptr,
                 uintptr_t exp_avg_sq_ptr, int64_t numel, int grad_dtype, int64_t step,
                 double lr, double beta1, double beta2, double eps, double weight_decay,
                 bool decoupled, double grad_scale, int num_threads) {
  if (grad_dtype != kFloat32 && grad_dtype != kBFloat16 && grad_dtype != kFloat16)
    throw std::invalid_argument("megazero._C.adam_update: unknown grad dtype code");
  if (numel < 0 || step < 1)
    throw std::invalid_argument("megazero._C.adam_update: need numel >= 0 and step >= 1");
  const StepScalars s = make_scalars(step, lr, beta1, beta2, eps, weight_decay, decoupled, grad_scale);
  float* param = reinterpret_cast<float*>(param_ptr);
  const void* grad = reinterpret_cast<const void*>(grad_ptr);
  float* exp_avg = reinterpret_cast<float*>(exp_avg_ptr);
  float* exp_avg_sq = reinterpret_cast<float*>(exp_avg_sq_ptr);
  const RangeFn range_fn = isa().fn;

  // Python's other threads (comm hooks, data loading) keep running while we stream memory.
  py::gil_scoped_release no_gil;
  int64_t threads = num_threads < 1 ? 1 : num_threads;
  if (threads > numel / kMinElementsPerThread) threads = numel / kMinElementsPerThread;
  if (threads < 1) threads = 1;
  // Each thread takes one contiguous block; the update is elementwise, so the split cannot change
  // any result. Blocks are whole multiples of 16 floats, so on a 64-byte-aligned buffer no two
  // threads write the same cache line.
  const int64_t block = ((numel + threads - 1) / threads + 15) / 16 * 16;
#ifdef _OPENMP  // without OpenMP the loop below simply runs its blocks one after another
#pragma omp parallel for num_threads(static_cast<int>(threads)) schedule(static, 1)
#endif
  for (int64_t t = 0; t < threads; ++t) {
    const int64_t begin = t * block;
    const int64_t end = begin + block < numel ? begin + block : numel;
    if (begin < end) range_fn(param, grad, grad_dtype, exp_avg, exp_avg_sq, begin, end, s);
  }
}

bool built_with_openmp() {
#ifdef _OPENMP
  return true;
#else
  return false;
#endif
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "megazero C++ kernels: fused CPU Adam(W) on flat fp32 partitions (csrc/cpu_adam.cpp).";
  m.def("adam_update", &adam_update,
        "One Adam(W) step in place on contiguous 1-D CPU buffers given by address. param, exp_avg and "
        "exp_avg_sq are fp32; grad_dtype is 0 fp32, 1 bf16, 2 fp16. Matches "
        "megazero.zero.adam.adam_update_reference (see csrc/cpu_adam.cpp); callers validate buffers.",
        py::arg("param_ptr"), py::arg("grad_ptr"), py::arg("exp_avg_ptr"), py::arg("exp_avg_sq_ptr"),
        py::arg("numel"), py::arg("grad_dtype"), py::arg("step"), py::arg("lr"), py::arg("beta1"),
        py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("decoupled"),
        py::arg("grad_scale"), py::arg("num_threads"));
  m.def("kernel_isa", [] { return std::string(isa().name); },
        "Which copy of the loop this CPU runs: 'avx2+fma' (picked at run time) or 'build target' "
        "(compiled for the build's own flags: baseline, or -march=native with MEGAZERO_NATIVE=1).");
  m.def("built_with_openmp", &built_with_openmp, "Whether the extension was compiled with OpenMP.");
}
