// Shared by the block-quantization translation units (quantize.cpp and one quantize_<isa>.cpp per
// instruction set): the arguments of one call and the declarations of each instruction set's loops.
//
// Format (megazero/ops/quantize.py documents it for users and holds the torch reference):
// the input is cut into blocks of `block_size` elements, the last one shorter when numel is not a
// multiple. Each block has an fp32 scale and, when asymmetric, an fp32 minimum. Codes are bytes:
// int8 one per byte, int4 two per byte (element 2j in the low nibble, 2j+1 in the high one); a
// block always occupies block_size (int8) or block_size/2 (int4) bytes, and the codes of the
// padding past numel are 0. Symmetric codes are two's complement, asymmetric ones unsigned.
#pragma once

#include <cstdint>

namespace megazero_quant {

enum Dtype : int { kFloat32 = 0, kBFloat16 = 1 };

struct Args {
  const void* x;          // quantize: input, `dtype`
  void* out;              // dequantize: output, `dtype`; dequantize_reduce: fp32
  uint8_t* codes;         // per chunk: num_blocks * bytes_per_block
  float* scales;          // per chunk: num_blocks
  float* mins;            // per chunk: num_blocks (asymmetric only, else nullptr)
  int64_t numel;          // elements per chunk
  int64_t block_size;
  int64_t num_blocks;     // ceil(numel / block_size)
  int64_t chunks;         // dequantize_reduce: how many quantized chunks are summed
  int dtype;
  int bits;               // 8 or 4
  bool symmetric;
};

// Each works on blocks [block_begin, block_end) of one call; blocks are independent, so any split
// of them between threads gives the same bits.
using RangeFn = void (*)(const Args& a, int64_t block_begin, int64_t block_end);

struct Kernels {
  RangeFn quantize;
  RangeFn dequantize;
  RangeFn dequantize_reduce;
};

Kernels kernels_scalar();
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define MEGAZERO_QUANT_X86 1
Kernels kernels_avx2();
Kernels kernels_avx512();
#else
#define MEGAZERO_QUANT_X86 0
#endif

}  // namespace megazero_quant
