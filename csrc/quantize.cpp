// megazero._quant: block-wise int8 / int4 quantization (symmetric or asymmetric, fp32 or bf16 in
// and out) and the fused dequantize-and-reduce of k quantized chunks into fp32, for ZeRO++'s
// quantized weight gathers and gradient reductions.
//
// This file owns the entry points (argument checks, instruction-set dispatch, OpenMP threads) and
// the pybind11 module. The loops are quantize_kernels.h, compiled once per instruction set in
// quantize_scalar.cpp / quantize_avx2.cpp / quantize_avx512.cpp; the format is described in
// quantize.h. Tensors are validated and allocated by megazero/ops/quantize.py, which passes raw
// addresses, so no libtorch headers are needed. Its pure-torch reference of every kernel is the
// oracle: codes, scales and dequantized values are bitwise equal to it on every path.
//
// Instruction sets: no -march flag; each copy carries its own target and is picked at run time
// from cpuid (__builtin_cpu_supports). A caller may force any path this CPU supports (the tests
// run each in turn).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu_dispatch.h"
#include "quantize.h"

namespace py = pybind11;

namespace megazero_quant {
namespace {

// Below this many elements per thread, waking threads costs more than the loop itself.
constexpr int64_t kMinElementsPerThread = 1 << 15;

using Isa = megazero_cpu::Isa<Kernels>;

// The copies compiled into this build, best first.
std::vector<Isa> detect_isas() {
  std::vector<Isa> isas;
#if MEGAZERO_QUANT_X86
  const megazero_cpu::CpuFeatures cpu = megazero_cpu::detect_features();
  isas.push_back({"avx512", kernels_avx512(), cpu.avx512});
  isas.push_back({"avx2", kernels_avx2(), cpu.avx2});
#endif
  isas.push_back({"scalar", kernels_scalar(), true});
  return isas;
}

const std::vector<Isa>& isas() {
  static const std::vector<Isa> detected = detect_isas();
  return detected;
}

const Isa& choose_isa(const std::string& name) {
  return megazero_cpu::choose_isa(isas(), name, "megazero._quant");
}

std::vector<std::string> supported_isas() { return megazero_cpu::supported_names(isas()); }

Args make_args(uintptr_t codes, uintptr_t scales, uintptr_t mins, int64_t numel, int bits,
               int64_t block_size, bool symmetric, int dtype) {
  if (bits != 8 && bits != 4) throw std::invalid_argument("megazero._quant: bits must be 8 or 4");
  if (block_size < 1 || (bits == 4 && block_size % 2 != 0))
    throw std::invalid_argument("megazero._quant: block_size must be >= 1 (and even for int4)");
  if (numel < 0) throw std::invalid_argument("megazero._quant: numel must be >= 0");
  if (dtype != kFloat32 && dtype != kBFloat16)
    throw std::invalid_argument("megazero._quant: dtype code must be 0 (fp32) or 1 (bf16)");
  if (symmetric != (mins == 0))
    throw std::invalid_argument("megazero._quant: give mins_ptr exactly when asymmetric");
  Args a{};
  a.codes = reinterpret_cast<uint8_t*>(codes);
  a.scales = reinterpret_cast<float*>(scales);
  a.mins = reinterpret_cast<float*>(mins);
  a.numel = numel;
  a.block_size = block_size;
  a.num_blocks = (numel + block_size - 1) / block_size;
  a.chunks = 1;
  a.dtype = dtype;
  a.bits = bits;
  a.symmetric = symmetric;
  return a;
}

// Splits the blocks into one contiguous run per thread; blocks are independent, so the split
// cannot change any result.
std::string run_blocks(RangeFn fn, const Args& a, int64_t work_elements, int num_threads,
                       const char* isa_name) {
  py::gil_scoped_release no_gil;
  int64_t threads = num_threads < 1 ? 1 : num_threads;
  if (threads > work_elements / kMinElementsPerThread) threads = work_elements / kMinElementsPerThread;
  if (threads > a.num_blocks) threads = a.num_blocks;
  if (threads < 1) threads = 1;
  const int64_t per_thread = (a.num_blocks + threads - 1) / threads;
#ifdef _OPENMP
#pragma omp parallel for num_threads(static_cast<int>(threads)) schedule(static, 1)
#endif
  for (int64_t t = 0; t < threads; ++t) {
    const int64_t begin = t * per_thread;
    const int64_t end = begin + per_thread < a.num_blocks ? begin + per_thread : a.num_blocks;
    if (begin < end) fn(a, begin, end);
  }
  return isa_name;
}

std::string quantize(uintptr_t x, int dtype, int64_t numel, uintptr_t codes, uintptr_t scales,
                     uintptr_t mins, int bits, int64_t block_size, bool symmetric, int num_threads,
                     const std::string& isa_name) {
  Args a = make_args(codes, scales, mins, numel, bits, block_size, symmetric, dtype);
  a.x = reinterpret_cast<const void*>(x);
  const Isa& isa = choose_isa(isa_name);
  return run_blocks(isa.impl.quantize, a, numel, num_threads, isa.name);
}

std::string dequantize(uintptr_t codes, uintptr_t scales, uintptr_t mins, int64_t numel, int bits,
                       int64_t block_size, bool symmetric, uintptr_t out, int dtype,
                       int num_threads, const std::string& isa_name) {
  Args a = make_args(codes, scales, mins, numel, bits, block_size, symmetric, dtype);
  a.out = reinterpret_cast<void*>(out);
  const Isa& isa = choose_isa(isa_name);
  return run_blocks(isa.impl.dequantize, a, numel, num_threads, isa.name);
}

std::string dequantize_reduce(uintptr_t codes, uintptr_t scales, uintptr_t mins, int64_t chunks,
                              int64_t numel, int bits, int64_t block_size, bool symmetric,
                              uintptr_t out, int num_threads, const std::string& isa_name) {
  if (chunks < 1) throw std::invalid_argument("megazero._quant: need at least one chunk to reduce");
  Args a = make_args(codes, scales, mins, numel, bits, block_size, symmetric, kFloat32);
  a.out = reinterpret_cast<void*>(out);
  a.chunks = chunks;
  const Isa& isa = choose_isa(isa_name);
  return run_blocks(isa.impl.dequantize_reduce, a, numel * chunks, num_threads, isa.name);
}

}  // namespace
}  // namespace megazero_quant

PYBIND11_MODULE(_quant, m) {
  using namespace megazero_quant;
  m.doc() = "megazero block quantization kernels (csrc/quantize*.cpp); use megazero.ops.quantize.";
  m.def("quantize", &quantize,
        "Block-quantize numel contiguous values at x (dtype 0 fp32, 1 bf16) into codes/scales/mins "
        "(mins_ptr 0 when symmetric). Returns the instruction set that ran.",
        py::arg("x_ptr"), py::arg("dtype"), py::arg("numel"), py::arg("codes_ptr"),
        py::arg("scales_ptr"), py::arg("mins_ptr"), py::arg("bits"), py::arg("block_size"),
        py::arg("symmetric"), py::arg("num_threads"), py::arg("isa") = "");
  m.def("dequantize", &dequantize,
        "Dequantize codes/scales/mins into numel values at out (dtype 0 fp32, 1 bf16).",
        py::arg("codes_ptr"), py::arg("scales_ptr"), py::arg("mins_ptr"), py::arg("numel"),
        py::arg("bits"), py::arg("block_size"), py::arg("symmetric"), py::arg("out_ptr"),
        py::arg("dtype"), py::arg("num_threads"), py::arg("isa") = "");
  m.def("dequantize_reduce", &dequantize_reduce,
        "Sum the dequantized values of `chunks` quantized chunks laid end to end into numel fp32 "
        "values at out, in chunk order.",
        py::arg("codes_ptr"), py::arg("scales_ptr"), py::arg("mins_ptr"), py::arg("chunks"),
        py::arg("numel"), py::arg("bits"), py::arg("block_size"), py::arg("symmetric"),
        py::arg("out_ptr"), py::arg("num_threads"), py::arg("isa") = "");
  m.def("supported_isas", &supported_isas,
        "The loop copies this CPU and build can run, best first: 'avx512', 'avx2', 'scalar'.");
  m.def("built_with_openmp", &megazero_cpu::built_with_openmp, "Whether the extension was compiled with OpenMP.");
}
