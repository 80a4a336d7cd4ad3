// The block quantize / dequantize / dequantize-and-reduce loops, written once in portable C++ and
// compiled once per instruction set: each quantize_<isa>.cpp sets a `#pragma GCC target` and the
// namespace name MEGAZERO_QUANT_ISA, then includes this file, so the compiler vectorizes the same
// source for that ISA (the `omp simd` pragmas make the min/max reductions vectorizable without
// -ffast-math). No `#pragma once`: every ISA file needs its own copy. Everything is in an anonymous
// namespace so no function built for AVX-512 can be merged by the linker into another path.
//
// Numerics (what the torch reference in megazero/ops/quantize.py computes, op for op, each rounded
// to fp32 once; -ffp-contract=off keeps the compiler from fusing any of them):
//   symmetric:  scale = max(|lo|, |hi|) / qmax (1 if that is 0);
//               q = clamp(round(x / scale), -qmax, qmax)
//               x' = q * scale
//   asymmetric: mn = lo + 0 (turns -0 into +0); scale = (hi - mn) / qmax (1 if 0);
//               q = clamp(round((x - mn) / scale), 0, qmax);  x' = q * scale + mn
// with lo/hi the block's min/max, qmax 127/7 (symmetric int8/int4) or 255/15 (asymmetric), round
// half to even. The rounding adds and subtracts 1.5 * 2^23, exact round-half-even for |v| < 2^22,
// and v is at most ~qmax here. A block holding a NaN or an infinity, or whose max - min overflows,
// gets scale NaN (min NaN), codes 0: it dequantizes to NaN (megazero/ops/quantize.py's rule).
#include <algorithm>
#include <cstdint>
#include <limits>

#include "dtype_helpers.h"
#include "quantize.h"

namespace megazero_quant {
namespace MEGAZERO_QUANT_ISA {
namespace {

using megazero_dtype::bf16_to_float;
using megazero_dtype::float_to_bf16;

template <int D>
MEGAZERO_INLINE float load(const void* p, int64_t i) {
  if constexpr (D == kBFloat16) return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
  else return static_cast<const float*>(p)[i];
}

template <int D>
MEGAZERO_INLINE void store(void* p, int64_t i, float v) {
  if constexpr (D == kBFloat16) static_cast<uint16_t*>(p)[i] = float_to_bf16(v);
  else static_cast<float*>(p)[i] = v;
}

MEGAZERO_INLINE float round_half_even(float v) {
  const float magic = 12582912.0f;  // 1.5 * 2^23: the sum's ulp is 1, so the add rounds to integer
  return (v + magic) - magic;
}

template <int Bits, bool Sym>
struct Levels {
  static constexpr float qmax = Sym ? float((1 << (Bits - 1)) - 1) : float((1 << Bits) - 1);
  static constexpr float qmin = Sym ? -qmax : 0.0f;
};

template <int Bits, bool Sym>
MEGAZERO_INLINE int code_of(float x, float mn, float scale) {
  const float v = Sym ? x / scale : (x - mn) / scale;
  // Clamped as an int (vectorizes without -ffast-math); a finite input keeps |v| <= ~qmax, far
  // inside int range.
  const int q = static_cast<int>(round_half_even(v));
  constexpr int lo = static_cast<int>(Levels<Bits, Sym>::qmin);
  constexpr int hi = static_cast<int>(Levels<Bits, Sym>::qmax);
  return std::min(std::max(q, lo), hi);
}

// Code -> value. `nibble` 0 is the whole byte (int8), 1 its low and 2 its high four bits (int4).
template <int Bits, bool Sym, int Nibble>
MEGAZERO_INLINE float value_of(uint8_t byte, float mn, float scale) {
  int q;
  if constexpr (Bits == 8) {
    q = Sym ? static_cast<int>(static_cast<int8_t>(byte)) : static_cast<int>(byte);
  } else {
    const int nibble = Nibble == 1 ? (byte & 0xf) : (byte >> 4);
    q = Sym ? (nibble ^ 8) - 8 : nibble;  // sign-extend the two's complement nibble
  }
  const float d = static_cast<float>(q) * scale;
  return Sym ? d : d + mn;
}

// Calls emit(i, value) for the `count` values of one block, int4 a byte (two values) at a time so
// the loop has no per-element shifts to compute.
template <int Bits, bool Sym, class Emit>
MEGAZERO_INLINE void for_each_value(const uint8_t* codes, int64_t count, float mn, float scale,
                                    Emit emit) {
  if constexpr (Bits == 8) {
#pragma omp simd
    for (int64_t i = 0; i < count; ++i) emit(i, value_of<Bits, Sym, 0>(codes[i], mn, scale));
  } else {
    const int64_t pairs = count / 2;
#pragma omp simd
    for (int64_t j = 0; j < pairs; ++j) {
      emit(2 * j, value_of<Bits, Sym, 1>(codes[j], mn, scale));
      emit(2 * j + 1, value_of<Bits, Sym, 2>(codes[j], mn, scale));
    }
    if (count & 1) emit(count - 1, value_of<Bits, Sym, 1>(codes[pairs], mn, scale));
  }
}

template <int D, int Bits, bool Sym>
void quantize_blocks(const Args& a, int64_t block_begin, int64_t block_end) {
  const int64_t bytes_per_block = Bits == 8 ? a.block_size : a.block_size / 2;
  // Read once: the byte stores below may alias anything, so a.x read inside a loop would be
  // reloaded on every iteration and block vectorization.
  const void* const x = a.x;
  for (int64_t b = block_begin; b < block_end; ++b) {
    const int64_t start = b * a.block_size;
    const int64_t count = start + a.block_size <= a.numel ? a.block_size : a.numel - start;
    float lo = load<D>(x, start), hi = lo;
    int bad = 0;  // a NaN or an infinity in the block (v - v is NaN exactly for those)
#pragma omp simd reduction(min : lo) reduction(max : hi) reduction(| : bad)
    for (int64_t i = 0; i < count; ++i) {
      const float v = load<D>(x, start + i);
      lo = v < lo ? v : lo;
      hi = v > hi ? v : hi;
      bad |= !(v - v == 0.0f);
    }
    float mn = 0.0f, scale;
    if (Sym) {
      const float absmax = -lo > hi ? -lo : hi;
      scale = absmax / Levels<Bits, Sym>::qmax;
    } else {
      mn = lo + 0.0f;
      scale = (hi - mn) / Levels<Bits, Sym>::qmax;
    }
    if (scale == 0.0f) scale = 1.0f;  // a constant block (or underflow): every code is exact/0
    uint8_t* codes = a.codes + b * bytes_per_block;
    if (bad || !(scale - scale == 0.0f)) {
      // Non-finite input (or an asymmetric range that overflows): scale NaN, codes 0, so the block
      // dequantizes to NaN and an overflowed gradient stays visible to the step's check.
      a.scales[b] = std::numeric_limits<float>::quiet_NaN();
      if (!Sym) a.mins[b] = std::numeric_limits<float>::quiet_NaN();
      for (int64_t j = 0; j < bytes_per_block; ++j) codes[j] = 0;
      continue;
    }
    a.scales[b] = scale;
    if (!Sym) a.mins[b] = mn;
    if constexpr (Bits == 8) {
#pragma omp simd
      for (int64_t i = 0; i < count; ++i)
        codes[i] = static_cast<uint8_t>(code_of<Bits, Sym>(load<D>(x, start + i), mn, scale));
      for (int64_t i = count; i < a.block_size; ++i) codes[i] = 0;
    } else {
      const int64_t pairs = count / 2;
#pragma omp simd
      for (int64_t j = 0; j < pairs; ++j) {
        const int q0 = code_of<Bits, Sym>(load<D>(x, start + 2 * j), mn, scale);
        const int q1 = code_of<Bits, Sym>(load<D>(x, start + 2 * j + 1), mn, scale);
        codes[j] = static_cast<uint8_t>((q0 & 0xf) | ((q1 & 0xf) << 4));
      }
      int64_t j = pairs;
      if (count & 1) {  // the odd last element of a partial block; its partner is padding
        const int q = code_of<Bits, Sym>(load<D>(x, start + count - 1), mn, scale);
        codes[j++] = static_cast<uint8_t>(q & 0xf);
      }
      for (; j < bytes_per_block; ++j) codes[j] = 0;
    }
  }
}

template <int D, int Bits, bool Sym>
void dequantize_blocks(const Args& a, int64_t block_begin, int64_t block_end) {
  const int64_t bytes_per_block = Bits == 8 ? a.block_size : a.block_size / 2;
  for (int64_t b = block_begin; b < block_end; ++b) {
    const int64_t start = b * a.block_size;
    const int64_t count = start + a.block_size <= a.numel ? a.block_size : a.numel - start;
    const uint8_t* codes = a.codes + b * bytes_per_block;
    const float scale = a.scales[b];
    const float mn = Sym ? 0.0f : a.mins[b];
    void* out = a.out;
    for_each_value<Bits, Sym>(codes, count, mn, scale,
                              [out, start](int64_t i, float v) { store<D>(out, start + i, v); });
  }
}

// out = ((0 + x'_0) + x'_1) + ... + x'_{k-1}, chunk by chunk in order, one block at a time so the
// block's partial sums stay in L1 between chunks.
template <int Bits, bool Sym>
void dequantize_reduce_blocks(const Args& a, int64_t block_begin, int64_t block_end) {
  const int64_t bytes_per_block = Bits == 8 ? a.block_size : a.block_size / 2;
  const int64_t chunk_bytes = a.num_blocks * bytes_per_block;
  float* out = static_cast<float*>(a.out);
  for (int64_t b = block_begin; b < block_end; ++b) {
    const int64_t start = b * a.block_size;
    const int64_t count = start + a.block_size <= a.numel ? a.block_size : a.numel - start;
    float* dst = out + start;
    for (int64_t i = 0; i < count; ++i) dst[i] = 0.0f;
    for (int64_t c = 0; c < a.chunks; ++c) {
      const uint8_t* codes = a.codes + c * chunk_bytes + b * bytes_per_block;
      const float scale = a.scales[c * a.num_blocks + b];
      const float mn = Sym ? 0.0f : a.mins[c * a.num_blocks + b];
      for_each_value<Bits, Sym>(codes, count, mn, scale,
                                [dst](int64_t i, float v) { dst[i] = dst[i] + v; });
    }
  }
}


void quantize_range(const Args& a, int64_t b0, int64_t b1) {
  const int key = (a.dtype == kBFloat16) * 4 + (a.bits == 4) * 2 + a.symmetric;
  switch (key) {
    case 0: return quantize_blocks<kFloat32, 8, false>(a, b0, b1);
    case 1: return quantize_blocks<kFloat32, 8, true>(a, b0, b1);
    case 2: return quantize_blocks<kFloat32, 4, false>(a, b0, b1);
    case 3: return quantize_blocks<kFloat32, 4, true>(a, b0, b1);
    case 4: return quantize_blocks<kBFloat16, 8, false>(a, b0, b1);
    case 5: return quantize_blocks<kBFloat16, 8, true>(a, b0, b1);
    case 6: return quantize_blocks<kBFloat16, 4, false>(a, b0, b1);
    default: return quantize_blocks<kBFloat16, 4, true>(a, b0, b1);
  }
}

void dequantize_range(const Args& a, int64_t b0, int64_t b1) {
  const int key = (a.dtype == kBFloat16) * 4 + (a.bits == 4) * 2 + a.symmetric;
  switch (key) {
    case 0: return dequantize_blocks<kFloat32, 8, false>(a, b0, b1);
    case 1: return dequantize_blocks<kFloat32, 8, true>(a, b0, b1);
    case 2: return dequantize_blocks<kFloat32, 4, false>(a, b0, b1);
    case 3: return dequantize_blocks<kFloat32, 4, true>(a, b0, b1);
    case 4: return dequantize_blocks<kBFloat16, 8, false>(a, b0, b1);
    case 5: return dequantize_blocks<kBFloat16, 8, true>(a, b0, b1);
    case 6: return dequantize_blocks<kBFloat16, 4, false>(a, b0, b1);
    default: return dequantize_blocks<kBFloat16, 4, true>(a, b0, b1);
  }
}

void dequantize_reduce_range(const Args& a, int64_t b0, int64_t b1) {
  const int key = (a.bits == 4) * 2 + a.symmetric;
  switch (key) {
    case 0: return dequantize_reduce_blocks<8, false>(a, b0, b1);
    case 1: return dequantize_reduce_blocks<8, true>(a, b0, b1);
    case 2: return dequantize_reduce_blocks<4, false>(a, b0, b1);
    default: return dequantize_reduce_blocks<4, true>(a, b0, b1);
  }
}

}  // namespace
}  // namespace MEGAZERO_QUANT_ISA
}  // namespace megazero_quant
