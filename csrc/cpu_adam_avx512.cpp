// The AVX-512 copy of the CPU Adam loop (cpu_adam.h's step_element, 16 floats at a time), one
// instantiation per gradient dtype, parameter-copy dtype and moment dtypes (fp32 / bf16 each).
//
// Compiled with a per-function target attribute, so the build needs no -m flags and the rest of
// the extension still runs on CPUs without AVX-512; cpu_adam.cpp calls it only where the CPU
// reports avx512f/bw/vl. The tail (fewer than 16 elements) uses masked loads and stores, so every
// element goes through the same instructions. Same operations, same order as step_element.
#include "cpu_adam.h"

#if MEGAZERO_X86_SIMD
#include <immintrin.h>

#define MEGAZERO_AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#define MEGAZERO_AVX512_INLINE static inline __attribute__((always_inline)) MEGAZERO_AVX512_TARGET

namespace megazero_adam {
namespace {

struct Constants512 {
  __m512 grad_scale, decay, l2, lerp_coeff, beta2, one_minus_beta2, bias2_sqrt, eps, neg_step_size;
  __mmask16 lerp_from_grad;  // all lanes or none
};

MEGAZERO_AVX512_INLINE Constants512 broadcast(const StepScalars& s) {
  return {_mm512_set1_ps(s.grad_scale), _mm512_set1_ps(s.decay), _mm512_set1_ps(s.l2),
          _mm512_set1_ps(s.lerp_coeff), _mm512_set1_ps(s.beta2), _mm512_set1_ps(s.one_minus_beta2),
          _mm512_set1_ps(s.bias2_sqrt), _mm512_set1_ps(s.eps), _mm512_set1_ps(s.neg_step_size),
          static_cast<__mmask16>(s.lerp_from_grad ? 0xffff : 0)};
}

template <bool Tail>
MEGAZERO_AVX512_INLINE __m512 load_f32(const float* p, __mmask16 k) {
  return Tail ? _mm512_maskz_loadu_ps(k, p) : _mm512_loadu_ps(p);
}

template <bool Tail>
MEGAZERO_AVX512_INLINE void store_f32(float* p, __m512 x, __mmask16 k) {
  if (Tail) _mm512_mask_storeu_ps(p, k, x);
  else _mm512_storeu_ps(p, x);
}

// A moment's 16 lanes: fp32 as they are, bf16 widened on load and rounded on store (load_state /
// store_state of cpu_adam.h; the store is store_copy<kBFloat16> below).
template <bool Bf16, bool Tail>
MEGAZERO_AVX512_INLINE __m512 load_state16(const void* base, int64_t i, __mmask16 k) {
  if constexpr (Bf16) {
    const uint16_t* p = static_cast<const uint16_t*>(base) + i;
    const __m256i h = Tail ? _mm256_maskz_loadu_epi16(k, p)
                           : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    return load_f32<Tail>(static_cast<const float*>(base) + i, k);
  }
}

template <int GradDtype, bool Tail>
MEGAZERO_AVX512_INLINE __m512 load_grad(const void* grad, int64_t i, __mmask16 k) {
  if constexpr (GradDtype == kFloat32) {
    return load_f32<Tail>(static_cast<const float*>(grad) + i, k);
  } else {
    const uint16_t* p = static_cast<const uint16_t*>(grad) + i;
    const __m256i h = Tail ? _mm256_maskz_loadu_epi16(k, p)
                           : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    if constexpr (GradDtype == kBFloat16)
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    else
      return _mm512_cvtph_ps(h);  // exact for every half, NaNs quieted (as fp16_to_float)
  }
}

// float_to_bf16 / float_to_fp16 of cpu_adam.h, 16 lanes at a time.
template <int CopyDtype, bool Tail>
MEGAZERO_AVX512_INLINE void store_copy(uint16_t* dst, __m512 p, __mmask16 k) {
  __m256i h;
  if constexpr (CopyDtype == kBFloat16) {
    const __m512i bits = _mm512_castps_si512(p);
    const __m512i high = _mm512_srli_epi32(bits, 16);
    const __m512i rounding = _mm512_add_epi32(_mm512_and_si512(high, _mm512_set1_epi32(1)),
                                              _mm512_set1_epi32(0x7fff));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, rounding), 16);
    const __m512i quiet_nan = _mm512_or_si512(high, _mm512_set1_epi32(0x40));
    const __mmask16 nan = _mm512_cmp_ps_mask(p, p, _CMP_UNORD_Q);
    h = _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet_nan));
  } else {
    h = _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  if (Tail) _mm256_mask_storeu_epi16(dst, k, h);
  else _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), h);
}

template <bool Bf16, bool Tail>
MEGAZERO_AVX512_INLINE void store_state16(void* base, int64_t i, __m512 x, __mmask16 k) {
  if constexpr (Bf16) store_copy<kBFloat16, Tail>(static_cast<uint16_t*>(base) + i, x, k);
  else store_f32<Tail>(static_cast<float*>(base) + i, x, k);
}

template <int GradDtype, int CopyDtype, int States, bool Tail>
MEGAZERO_AVX512_INLINE void step16(const Buffers& b, int64_t i, __mmask16 k, const Constants512& c,
                                   bool decay_param, bool l2_grad) {
  __m512 g = _mm512_mul_ps(load_grad<GradDtype, Tail>(b.grad, i, k), c.grad_scale);
  __m512 p = load_f32<Tail>(b.param + i, k);
  if (decay_param) p = _mm512_mul_ps(p, c.decay);
  if (l2_grad) g = _mm512_fmadd_ps(p, c.l2, g);
  constexpr bool m_bf16 = (States & kExpAvgBf16) != 0, v_bf16 = (States & kExpAvgSqBf16) != 0;
  const __m512 m_old = load_state16<m_bf16, Tail>(b.exp_avg, i, k);
  const __m512 base = _mm512_mask_blend_ps(c.lerp_from_grad, m_old, g);
  const __m512 m = _mm512_fmadd_ps(c.lerp_coeff, _mm512_sub_ps(g, m_old), base);
  const __m512 v_scaled = _mm512_mul_ps(load_state16<v_bf16, Tail>(b.exp_avg_sq, i, k), c.beta2);
  const __m512 v = _mm512_fmadd_ps(_mm512_mul_ps(c.one_minus_beta2, g), g, v_scaled);
  const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), c.bias2_sqrt), c.eps);
  p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(c.neg_step_size, m), denom));
  store_state16<m_bf16, Tail>(b.exp_avg, i, m, k);
  store_state16<v_bf16, Tail>(b.exp_avg_sq, i, v, k);
  store_f32<Tail>(b.param + i, p, k);
  if constexpr (CopyDtype != kNone) store_copy<CopyDtype, Tail>(b.param_copy + i, p, k);
}

template <int GradDtype, int CopyDtype, int States>
MEGAZERO_AVX512_TARGET void range_typed(const Buffers& b, int64_t begin, int64_t end,
                                        const StepScalars& s) {
  const Constants512 c = broadcast(s);
  int64_t i = begin;
  for (; i + 16 <= end; i += 16)
    step16<GradDtype, CopyDtype, States, false>(b, i, 0xffff, c, s.decay_param, s.l2_grad);
  if (i < end) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (end - i)) - 1u);
    step16<GradDtype, CopyDtype, States, true>(b, i, tail, c, s.decay_param, s.l2_grad);
  }
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

void range_avx512(const Buffers& b, int64_t begin, int64_t end, const StepScalars& s) {
  if (b.grad_dtype == kBFloat16) range_grad_typed<kBFloat16>(b, begin, end, s);
  else if (b.grad_dtype == kFloat16) range_grad_typed<kFloat16>(b, begin, end, s);
  else range_grad_typed<kFloat32>(b, begin, end, s);
}

}  // namespace megazero_adam

#endif  // MEGAZERO_X86_SIMD
