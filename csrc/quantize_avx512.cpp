// The AVX-512 copy of the block-quantization loops (F/BW/VL, 512-bit vectors; quantize.cpp calls
// it only where the CPU reports them).
// The loops themselves are quantize_kernels.h, compiled here for this instruction set.
#include <cstdint>
#include <cstring>

#include "quantize.h"

#if MEGAZERO_QUANT_X86
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c,prefer-vector-width=512")
#define MEGAZERO_QUANT_ISA isa_avx512
#include "quantize_kernels.h"

namespace megazero_quant {
Kernels kernels_avx512() {
  return {isa_avx512::quantize_range, isa_avx512::dequantize_range, isa_avx512::dequantize_reduce_range};
}
}  // namespace megazero_quant
#endif  // MEGAZERO_QUANT_X86

