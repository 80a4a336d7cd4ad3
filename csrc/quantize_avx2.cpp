// The AVX2 copy of the block-quantization loops (AVX2 + FMA + F16C; quantize.cpp calls it only
// where the CPU reports them).
// The loops themselves are quantize_kernels.h, compiled here for this instruction set.
#include <cstdint>
#include <cstring>

#include "quantize.h"

#if MEGAZERO_QUANT_X86
#pragma GCC target("avx2,fma,f16c")
#define MEGAZERO_QUANT_ISA isa_avx2
#include "quantize_kernels.h"

namespace megazero_quant {
Kernels kernels_avx2() {
  return {isa_avx2::quantize_range, isa_avx2::dequantize_range, isa_avx2::dequantize_reduce_range};
}
}  // namespace megazero_quant
#endif  // MEGAZERO_QUANT_X86

