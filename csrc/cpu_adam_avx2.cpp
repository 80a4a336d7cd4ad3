// The AVX2+FMA copy of the CPU Adam loop (cpu_adam.h's step_element, 8 floats at a time), one
// instantiation per gradient dtype, parameter-copy dtype and moment dtypes (fp32 / bf16 each).
//
// Compiled with a per-function target attribute (no -m flags in the build); cpu_adam.cpp calls it
// only where the CPU reports avx2, fma and f16c. AVX2 has no masked 16-bit loads, so the last
// (fewer than 8) elements go through step_element itself, compiled here with the same target:
// the same operations in the same order, hence the same bits.
#include "cpu_adam.h"

#if MEGAZERO_X86_SIMD
#include <immintrin.h>

#define MEGAZERO_AVX2_TARGET __attribute__((target("avx2,fma,f16c")))
#define MEGAZERO_AVX2_INLINE static inline __attribute__((always_inline)) MEGAZERO_AVX2_TARGET

namespace megazero_adam {
namespace {

struct Constants256 {
  __m256 grad_scale, decay, l2, lerp_coeff, beta2, one_minus_beta2, bias2_sqrt, eps, neg_step_size;
  __m256 lerp_from_grad;  // all bits of every lane, or none
};

MEGAZERO_AVX2_INLINE Constants256 broadcast(const StepScalars& s) {
  return {_mm256_set1_ps(s.grad_scale), _mm256_set1_ps(s.decay), _mm256_set1_ps(s.l2),
          _mm256_set1_ps(s.lerp_coeff), _mm256_set1_ps(s.beta2), _mm256_set1_ps(s.one_minus_beta2),
          _mm256_set1_ps(s.bias2_sqrt), _mm256_set1_ps(s.eps), _mm256_set1_ps(s.neg_step_size),
          _mm256_castsi256_ps(_mm256_set1_epi32(s.lerp_from_grad ? -1 : 0))};
}

template <int GradDtype>
MEGAZERO_AVX2_INLINE __m256 load_grad(const void* grad, int64_t i) {
  if constexpr (GradDtype == kFloat32) {
    return _mm256_loadu_ps(static_cast<const float*>(grad) + i);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(
        static_cast<const uint16_t*>(grad) + i));
    if constexpr (GradDtype == kBFloat16)
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    else
      return _mm256_cvtph_ps(h);  // exact for every half, NaNs quieted (as fp16_to_float)
  }
}

// float_to_bf16 / float_to_fp16 of cpu_adam.h, 8 lanes at a time.
template <int CopyDtype>
MEGAZERO_AVX2_INLINE void store_copy(uint16_t* dst, __m256 p) {
  __m128i h;
  if constexpr (CopyDtype == kBFloat16) {
    const __m256i bits = _mm256_castps_si256(p);
    const __m256i high = _mm256_srli_epi32(bits, 16);
    const __m256i rounding = _mm256_add_epi32(_mm256_and_si256(high, _mm256_set1_epi32(1)),
                                              _mm256_set1_epi32(0x7fff));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, rounding), 16);
    const __m256i quiet_nan = _mm256_or_si256(high, _mm256_set1_epi32(0x40));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(p, p, _CMP_UNORD_Q));
    const __m256i halves = _mm256_blendv_epi8(rounded, quiet_nan, nan);  // each lane <= 0xffff
    h = _mm_packus_epi32(_mm256_castsi256_si128(halves), _mm256_extracti128_si256(halves, 1));
  } else {
    h = _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), h);
}

// A moment's 8 lanes: fp32 as they are, bf16 widened on load and rounded on store (load_state /
// store_state of cpu_adam.h).
template <bool Bf16>
MEGAZERO_AVX2_INLINE __m256 load_state8(const void* base, int64_t i) {
  if constexpr (Bf16) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    return _mm256_loadu_ps(static_cast<const float*>(base) + i);
  }
}

template <bool Bf16>
MEGAZERO_AVX2_INLINE void store_state8(void* base, int64_t i, __m256 x) {
  if constexpr (Bf16) store_copy<kBFloat16>(static_cast<uint16_t*>(base) + i, x);
  else _mm256_storeu_ps(static_cast<float*>(base) + i, x);
}

template <int GradDtype, int CopyDtype, int States>
MEGAZERO_AVX2_INLINE void step8(const Buffers& b, int64_t i, const Constants256& c,
                                bool decay_param, bool l2_grad) {
  __m256 g = _mm256_mul_ps(load_grad<GradDtype>(b.grad, i), c.grad_scale);
  __m256 p = _mm256_loadu_ps(b.param + i);
  if (decay_param) p = _mm256_mul_ps(p, c.decay);
  if (l2_grad) g = _mm256_fmadd_ps(p, c.l2, g);
  constexpr bool m_bf16 = (States & kExpAvgBf16) != 0, v_bf16 = (States & kExpAvgSqBf16) != 0;
  const __m256 m_old = load_state8<m_bf16>(b.exp_avg, i);
  const __m256 base = _mm256_blendv_ps(m_old, g, c.lerp_from_grad);
  const __m256 m = _mm256_fmadd_ps(c.lerp_coeff, _mm256_sub_ps(g, m_old), base);
  const __m256 v_scaled = _mm256_mul_ps(load_state8<v_bf16>(b.exp_avg_sq, i), c.beta2);
  const __m256 v = _mm256_fmadd_ps(_mm256_mul_ps(c.one_minus_beta2, g), g, v_scaled);
  const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), c.bias2_sqrt), c.eps);
  p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(c.neg_step_size, m), denom));
  store_state8<m_bf16>(b.exp_avg, i, m);
  store_state8<v_bf16>(b.exp_avg_sq, i, v);
  _mm256_storeu_ps(b.param + i, p);
  if constexpr (CopyDtype != kNone) store_copy<CopyDtype>(b.param_copy + i, p);
}

template <int GradDtype, int CopyDtype, int States>
MEGAZERO_AVX2_TARGET void range_typed(const Buffers& b, int64_t begin, int64_t end,
                                      const StepScalars& s) {
  const Constants256 c = broadcast(s);
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) step8<GradDtype, CopyDtype, States>(b, i, c, s.decay_param, s.l2_grad);
  for (; i < end; ++i) step_element(b, i, s);
}

template <int GradDtype, int CopyDtype>
void range_states_typed(const Buffers& b, int64_t begin, int64_t end, const StepScalars& s) {
  switch (state_code(b)) {
    case kStatesFp32: return range_typed<GradDtype, CopyDtype, kStatesFp32>(b, begin, end, s);
    case kExpAvgBf16: return range_typed<GradDtype, CopyDtype, kExpAvgBf16>(b, begin, end, s);
    case kExpAvgSqBf16: return range_typed<GradDtype, CopyDtype, kExpAvgSqBf16>(b, begin, end, s);
    default: return range_typed<GradDtype, CopyDtype, kExpAvgBf16 | kExpAvgSqBf16>(b, begin, end, s);
  }
}

template <int GradDtype>
void range_grad_typed(const Buffers& b, int64_t begin, int64_t end, const StepScalars& s) {
  if (b.copy_dtype == kBFloat16) range_states_typed<GradDtype, kBFloat16>(b, begin, end, s);
  else if (b.copy_dtype == kFloat16) range_states_typed<GradDtype, kFloat16>(b, begin, end, s);
  else range_states_typed<GradDtype, kNone>(b, begin, end, s);
}

}  // namespace

void range_avx2(const Buffers& b, int64_t begin, int64_t end, const StepScalars& s) {
  if (b.grad_dtype == kBFloat16) range_grad_typed<kBFloat16>(b, begin, end, s);
  else if (b.grad_dtype == kFloat16) range_grad_typed<kFloat16>(b, begin, end, s);
  else range_grad_typed<kFloat32>(b, begin, end, s);
}

}  // namespace megazero_adam

#endif  // MEGAZERO_X86_SIMD
