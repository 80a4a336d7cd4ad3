// The scalar copy of the block-quantization loops: baseline x86-64 (SSE2), or whatever the build
// targets; always available.
// The loops themselves are quantize_kernels.h, compiled here for this instruction set.
#include <cstdint>
#include <cstring>

#include "quantize.h"


#define MEGAZERO_QUANT_ISA isa_scalar
#include "quantize_kernels.h"

namespace megazero_quant {
Kernels kernels_scalar() {
  return {isa_scalar::quantize_range, isa_scalar::dequantize_range, isa_scalar::dequantize_reduce_range};
}
}  // namespace megazero_quant

