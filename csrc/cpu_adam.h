// Shared by the CPU Adam translation units: the per-step scalars, the buffers one call updates, the
// scalar per-element step, and the declarations of each instruction set's copy of the loop.
//
// This header owns the numerics every path must reproduce (see cpu_adam.cpp's top comment for why
// each operation is what it is). The SIMD files (cpu_adam_avx2.cpp, cpu_adam_avx512.cpp) restate the
// same operations in intrinsics, in the same order, so every path gives the same bits.
//
// Everything defined here is `static`: the SIMD files compile some of it inside functions with a
// wider target ISA, and an inline function with external linkage could then be merged by the
// linker into one copy built for AVX-512 and called on a CPU without it.
#pragma once

#include <cstdint>

#include "dtype_helpers.h"

namespace megazero_adam {

using megazero_dtype::bf16_to_float;
using megazero_dtype::bits_from_float;
using megazero_dtype::float_from_bits;
using megazero_dtype::float_to_bf16;

// Dtype codes shared with megazero/ops/adam.py. Gradients may be any of the three; the fused
// low-precision copy of the parameter is bf16 or fp16, and kNone means no copy is written. Each
// Adam moment is stored in fp32 or bf16 (Megatron-LM's --exp-avg-dtype / --exp-avg-sq-dtype).
enum Dtype : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };
constexpr int kNone = -1;

// Every per-step constant, already rounded to fp32 exactly where torch rounds it.
struct StepScalars {
  float grad_scale;       // grad.float().mul_(grad_scale)
  bool decay_param;       // AdamW with weight decay: param.mul_(decay) first
  float decay;            // 1 - lr * wd
  bool l2_grad;           // Adam with weight decay: grad.add(param, alpha=wd)
  float l2;               // wd
  float lerp_coeff;       // 1 - beta1, or (1 - beta1) - 1 when torch's lerp takes its other branch
  bool lerp_from_grad;    // that other branch: start from g rather than m
  float beta2;            // exp_avg_sq.mul_(beta2)
  float one_minus_beta2;  // addcmul_(value=1 - beta2)
  float bias2_sqrt;       // .div_(sqrt(1 - beta2^step))
  float eps;              // .add_(eps)
  float neg_step_size;    // addcdiv_(value=-lr / (1 - beta1^step))
};

// The buffers of one call: contiguous, `numel` long, never overlapping one another.
struct Buffers {
  float* param;
  const void* grad;        // Dtype grad_dtype
  void* exp_avg;           // Dtype exp_avg_dtype: kFloat32 or kBFloat16
  void* exp_avg_sq;        // Dtype exp_avg_sq_dtype: kFloat32 or kBFloat16
  uint16_t* param_copy;    // bf16 or fp16 bits, or nullptr
  int grad_dtype;
  int copy_dtype;          // kBFloat16, kFloat16 or kNone
  int exp_avg_dtype;
  int exp_avg_sq_dtype;
};

// Which moments are bf16, as one template argument of the SIMD loops: bit 0 exp_avg, bit 1 exp_avg_sq.
constexpr int kStatesFp32 = 0, kExpAvgBf16 = 1, kExpAvgSqBf16 = 2;
MEGAZERO_INLINE int state_code(const Buffers& b) {
  return (b.exp_avg_dtype == kBFloat16 ? kExpAvgBf16 : 0) |
         (b.exp_avg_sq_dtype == kBFloat16 ? kExpAvgSqBf16 : 0);
}

// Updates elements [begin, end) of `b`, one definition per instruction set. The SIMD copies are
// compiled with GCC/Clang target attributes on x86 only; elsewhere the scalar copy serves alone.
using RangeFn = void (*)(const Buffers& b, int64_t begin, int64_t end, const StepScalars& s);
void range_scalar(const Buffers& b, int64_t begin, int64_t end, const StepScalars& s);
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define MEGAZERO_X86_SIMD 1
void range_avx2(const Buffers& b, int64_t begin, int64_t end, const StepScalars& s);
void range_avx512(const Buffers& b, int64_t begin, int64_t end, const StepScalars& s);
#else
#define MEGAZERO_X86_SIMD 0
#endif

// IEEE half -> float, exact for every input, with integer selects rather than branches and no
// fp32 subnormal intermediates (so flush-to-zero / denormals-are-zero modes cannot change it).
MEGAZERO_INLINE float fp16_to_float(uint16_t bits) {
  const uint32_t half = bits;
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

// float -> IEEE half, round to nearest even, overflow to infinity, subnormals rounded exactly
// (what torch's .to(torch.float16) and the F16C instruction give).
MEGAZERO_INLINE uint16_t float_to_fp16(float value) {
  const uint32_t bits = bits_from_float(value);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u)  // NaN: quiet, top payload bits kept
    return sign | 0x7e00u | static_cast<uint16_t>((magnitude >> 13) & 0x3ffu);
  if (magnitude >= 0x477ff000u)  // >= 65520, halfway past the largest half: rounds to infinity
    return sign | 0x7c00u;
  if (magnitude < 0x38800000u) {  // below 2^-14: a half subnormal (or zero)
    // Adding 0.5 puts the value's 2^-24 units into the low mantissa bits of a float in [0.5, 1),
    // and the fp32 add rounds them to nearest even, exactly as the half conversion must.
    const float shifted = float_from_bits(magnitude) + 0.5f;
    return sign | static_cast<uint16_t>(bits_from_float(shifted) - 0x3f000000u);
  }
  // Normal: rebias the exponent (127 -> 15) and round away the low 13 mantissa bits to even.
  const uint32_t odd = (magnitude >> 13) & 1u;
  const uint32_t rebiased = magnitude - ((127u - 15u) << 23) + 0xfffu + odd;
  return sign | static_cast<uint16_t>(rebiased >> 13);
}

// A moment is read widened to fp32 (exact for bf16) and written back rounded to nearest even:
// the step computes in fp32 whatever the storage, as Transformer Engine's FusedAdam does with
// its exp_avg_dtype / exp_avg_sq_dtype.
MEGAZERO_INLINE float load_state(const void* base, int dtype, int64_t i) {
  if (dtype == kBFloat16) return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
  return static_cast<const float*>(base)[i];
}

MEGAZERO_INLINE void store_state(void* base, int dtype, int64_t i, float value) {
  if (dtype == kBFloat16) static_cast<uint16_t*>(base)[i] = float_to_bf16(value);
  else static_cast<float*>(base)[i] = value;
}

MEGAZERO_INLINE float load_grad(const Buffers& b, int64_t i) {
  if (b.grad_dtype == kBFloat16) return bf16_to_float(static_cast<const uint16_t*>(b.grad)[i]);
  if (b.grad_dtype == kFloat16) return fp16_to_float(static_cast<const uint16_t*>(b.grad)[i]);
  return static_cast<const float*>(b.grad)[i];
}

// The whole step for one element: torch.optim.AdamW's ops, one for one, rounded where torch
// rounds them (the fma's are the multiply-adds torch's vectorised CPU kernels fuse). The parameter
// update reads this step's fp32 moments; only what is stored is rounded to a bf16 moment's dtype.
MEGAZERO_INLINE void step_element(const Buffers& b, int64_t i, const StepScalars& s) {
  float g = load_grad(b, i) * s.grad_scale;
  float p = b.param[i];
  if (s.decay_param) p = p * s.decay;
  if (s.l2_grad) g = __builtin_fmaf(p, s.l2, g);
  const float m_old = load_state(b.exp_avg, b.exp_avg_dtype, i);
  const float m = __builtin_fmaf(s.lerp_coeff, g - m_old, s.lerp_from_grad ? g : m_old);
  const float v = __builtin_fmaf(s.one_minus_beta2 * g, g,
                                 load_state(b.exp_avg_sq, b.exp_avg_sq_dtype, i) * s.beta2);
  const float denom = __builtin_sqrtf(v) / s.bias2_sqrt + s.eps;
  p = p + (s.neg_step_size * m) / denom;
  store_state(b.exp_avg, b.exp_avg_dtype, i, m);
  store_state(b.exp_avg_sq, b.exp_avg_sq_dtype, i, v);
  b.param[i] = p;
  if (b.copy_dtype == kBFloat16) b.param_copy[i] = float_to_bf16(p);
  if (b.copy_dtype == kFloat16) b.param_copy[i] = float_to_fp16(p);
}

}  // namespace megazero_adam
