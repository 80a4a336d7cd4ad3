// The 16-bit float helpers both kernels use (cpu_adam*.cpp and the quantize loops), written once:
// MEGAZERO_INLINE, fp32 <-> bits, and bf16 <-> fp32.
//
// Everything is `static` (through MEGAZERO_INLINE): a file that includes this under a wider target
// ISA (the quantize loops' `#pragma GCC target`, the Adam SIMD files' target attributes) gets its
// own copy, so the linker can never merge a copy built for AVX-512 into a path run on a CPU
// without it.
#pragma once

#include <cstdint>
#include <cstring>

#define MEGAZERO_INLINE static inline __attribute__((always_inline))

namespace megazero_dtype {

MEGAZERO_INLINE float float_from_bits(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

MEGAZERO_INLINE uint32_t bits_from_float(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

// bf16 is the top half of an fp32, so widening is exact: shift the bits back up.
MEGAZERO_INLINE float bf16_to_float(uint16_t bits) {
  return float_from_bits(static_cast<uint32_t>(bits) << 16);
}

// float -> bf16, round to nearest even: bitwise what torch's .to(torch.bfloat16) gives for every
// non-NaN input (inf, subnormals and ties included). A NaN stays NaN: sign and top payload bits
// kept and the quiet bit set, as the hardware conversion does, since a plain rounding of a NaN with
// a low payload would turn it into infinity. (torch's CPU kernels write 0xffff for every NaN; the
// tests hold NaN payloads outside the contract.) Selects rather than branches, so the loops that
// store bf16 vectorize; the Adam SIMD files restate it in intrinsics.
MEGAZERO_INLINE uint16_t float_to_bf16(float value) {
  const uint32_t bits = bits_from_float(value);
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (bits >> 16) | 0x40u;
  return static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

}  // namespace megazero_dtype
