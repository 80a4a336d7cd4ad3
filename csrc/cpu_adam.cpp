// megazero._C: the fused CPU Adam(W) step for flat fp32 partitions, with an optional bf16/fp16
// copy of the updated parameter written in the same pass, and Adam moments kept in fp32 or bf16.
//
// This file owns the kernel's entry point `adam_update` (scalars, instruction-set dispatch, OpenMP
// threads), the scalar copy of the loop, and the pybind11 module. The SIMD copies of the loop live
// in cpu_adam_avx2.cpp and cpu_adam_avx512.cpp, the shared per-element numerics in cpu_adam.h. It
// does not own the optimizer's policy (when to step, which segments get weight decay, loss
// scaling): megazero/ops/adam.py decides that, checks every tensor, and passes raw pointers
// (`tensor.data_ptr()`), so this extension needs no libtorch headers and builds in seconds.
//
// Numerics. The oracle is `adam_update_reference` in megazero/ops/adam.py, i.e. the sequence of
// torch ops torch.optim.AdamW runs. Each of those ops rounds to fp32 once per element, and torch's
// AVX2/AVX-512 CPU kernels fuse three of them into a single fma:
//   lerp_(g, w)             -> fma(w, g - m, m)        when |w| < 0.5
//                              fma(w - 1, g - m, g)    otherwise
//   addcmul_(g, g, value=c) -> fma(c * g, g, v)
//   add(p, alpha=wd)        -> fma(p, wd, g)
// Every path repeats those steps one for one, in the same order, with scalars rounded to fp32 the
// way torch rounds a Python float; sqrt and division are IEEE (correctly rounded) in every
// instruction set, so the scalar, AVX2 and AVX-512 paths give identical bits. That requires
// building with -ffp-contract=off (setup.py does): otherwise the compiler could fuse `p * decay`
// into the final add, which torch does not. Result: exp_avg and exp_avg_sq are bitwise equal to
// the reference. param is too, except where torch's sqrt is not correctly rounded: torch builds
// with MKL (the x86 wheels) take fp32 sqrt from MKL's vector math, one ulp off for ~20% of
// inputs. param then differs by a few ulps (tests/ops/test_adam.py states the bound and checks
// bitwise equality against the reference with a correctly rounded sqrt). torch's
// DEFAULT-capability (non-AVX2) kernels fuse nothing; against those every fma step differs by one
// rounding. The 16-bit copy is the updated fp32 parameter rounded to nearest even, as
// `param.to(torch.bfloat16)` / `.to(torch.float16)` round it. A bf16 moment is widened exactly,
// the step runs in fp32 as above (the parameter update reads this step's fp32 moments), and the
// moment is stored rounded to nearest even, as `.to(torch.bfloat16)` rounds: deterministic and
// independent of the layout, so every ZeRO partitioning stores the same bits (stochastic rounding
// would need a random stream keyed by each element's global position to be).
//
// Instruction sets. No -march flag is used: the cluster image is built once and runs on many CPU
// models. Each SIMD copy is compiled with a per-function target attribute and chosen at run time
// from what the CPU reports (cpuid, through __builtin_cpu_supports); a caller can force any path
// this CPU supports, which is how the tests run all of them.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu_adam.h"
#include "cpu_dispatch.h"

namespace py = pybind11;

namespace megazero_adam {

// Below this many elements per thread, waking threads costs more than the loop itself.
constexpr int64_t kMinElementsPerThread = 1 << 16;

void range_scalar(const Buffers& b, int64_t begin, int64_t end, const StepScalars& s) {
  for (int64_t i = begin; i < end; ++i) step_element(b, i, s);
}

namespace {

StepScalars make_scalars(int64_t step, double lr, double beta1, double beta2, double eps,
                         double weight_decay, bool decoupled, double grad_scale) {
  // Python computes these in double and torch casts each to fp32 when it meets an fp32 tensor;
  // pow comes from the same libm Python's `**` calls, so the doubles agree to the last bit.
  StepScalars s{};
  s.grad_scale = static_cast<float>(grad_scale);
  s.decay_param = weight_decay != 0.0 && decoupled;
  s.decay = static_cast<float>(1.0 - lr * weight_decay);
  s.l2_grad = weight_decay != 0.0 && !decoupled;
  s.l2 = static_cast<float>(weight_decay);
  const float weight = static_cast<float>(1.0 - beta1);
  s.lerp_from_grad = !(std::fabs(weight) < 0.5f);
  s.lerp_coeff = s.lerp_from_grad ? weight - 1.0f : weight;
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  const double step_d = static_cast<double>(step);
  // pow(x, 0.5), not sqrt(x): torch's AdamW writes `bias_correction2 ** 0.5`.
  s.bias2_sqrt = static_cast<float>(std::pow(1.0 - std::pow(beta2, step_d), 0.5));
  s.eps = static_cast<float>(eps);
  s.neg_step_size = static_cast<float>(-(lr / (1.0 - std::pow(beta1, step_d))));
  return s;
}

using Isa = megazero_cpu::Isa<RangeFn>;

// The copies compiled into this build, best first.
std::vector<Isa> detect_isas() {
  std::vector<Isa> isas;
#if MEGAZERO_X86_SIMD
  const megazero_cpu::CpuFeatures cpu = megazero_cpu::detect_features();
  isas.push_back({"avx512", range_avx512, cpu.avx512});
  isas.push_back({"avx2", range_avx2, cpu.avx2});
#endif
  isas.push_back({"scalar", range_scalar, true});
  return isas;
}

const std::vector<Isa>& isas() {
  static const std::vector<Isa> detected = detect_isas();
  return detected;
}

const Isa& choose_isa(const std::string& name) {
  return megazero_cpu::choose_isa(isas(), name, "megazero._C.adam_update");
}

std::vector<std::string> supported_isas() { return megazero_cpu::supported_names(isas()); }

std::string adam_update(uintptr_t param_ptr, uintptr_t grad_ptr, uintptr_t exp_avg_ptr,
                        uintptr_t exp_avg_sq_ptr, int64_t numel, int grad_dtype, int64_t step,
                        double lr, double beta1, double beta2, double eps, double weight_decay,
                        bool decoupled, double grad_scale, int num_threads,
                        uintptr_t param_copy_ptr, int copy_dtype, const std::string& isa_name,
                        int exp_avg_dtype, int exp_avg_sq_dtype) {
  if (grad_dtype != kFloat32 && grad_dtype != kBFloat16 && grad_dtype != kFloat16)
    throw std::invalid_argument("megazero._C.adam_update: unknown grad dtype code");
  if (copy_dtype != kNone && copy_dtype != kBFloat16 && copy_dtype != kFloat16)
    throw std::invalid_argument("megazero._C.adam_update: the param copy must be bf16 (1) or fp16 (2)");
  for (const int state_dtype : {exp_avg_dtype, exp_avg_sq_dtype})
    if (state_dtype != kFloat32 && state_dtype != kBFloat16)
      throw std::invalid_argument("megazero._C.adam_update: a moment must be fp32 (0) or bf16 (1)");
  if ((copy_dtype == kNone) != (param_copy_ptr == 0))
    throw std::invalid_argument("megazero._C.adam_update: give param_copy_ptr and copy_dtype together");
  if (numel < 0 || step < 1)
    throw std::invalid_argument("megazero._C.adam_update: need numel >= 0 and step >= 1");
  const Isa& isa = choose_isa(isa_name);
  const StepScalars s = make_scalars(step, lr, beta1, beta2, eps, weight_decay, decoupled, grad_scale);
  const Buffers b{reinterpret_cast<float*>(param_ptr), reinterpret_cast<const void*>(grad_ptr),
                  reinterpret_cast<void*>(exp_avg_ptr), reinterpret_cast<void*>(exp_avg_sq_ptr),
                  reinterpret_cast<uint16_t*>(param_copy_ptr), grad_dtype, copy_dtype,
                  exp_avg_dtype, exp_avg_sq_dtype};

  // Python's other threads (comm hooks, data loading) keep running while we stream memory.
  py::gil_scoped_release no_gil;
  int64_t threads = num_threads < 1 ? 1 : num_threads;
  if (threads > numel / kMinElementsPerThread) threads = numel / kMinElementsPerThread;
  if (threads < 1) threads = 1;
  // Each thread takes one contiguous block; the update is elementwise, so the split cannot change
  // any result. Blocks are whole multiples of 32 elements, so on 64-byte-aligned buffers no two
  // threads write the same cache line, of the fp32 states or of the 16-bit copy.
  const int64_t block = ((numel + threads - 1) / threads + 31) / 32 * 32;
  const RangeFn range = isa.impl;
#ifdef _OPENMP  // without OpenMP the loop below simply runs its blocks one after another
#pragma omp parallel for num_threads(static_cast<int>(threads)) schedule(static, 1)
#endif
  for (int64_t t = 0; t < threads; ++t) {
    const int64_t begin = t * block;
    const int64_t end = begin + block < numel ? begin + block : numel;
    if (begin < end) range(b, begin, end, s);
  }
  return isa.name;
}

}  // namespace
}  // namespace megazero_adam

PYBIND11_MODULE(_C, m) {
  using namespace megazero_adam;
  m.doc() = "megazero C++ kernels: fused CPU Adam(W) on flat fp32 partitions (csrc/cpu_adam.cpp).";
  m.def("adam_update", &adam_update,
        "One Adam(W) step in place on contiguous 1-D CPU buffers given by address. param is fp32, "
        "exp_avg and exp_avg_sq fp32 or bf16 (exp_avg_dtype / exp_avg_sq_dtype 0 fp32, 1 bf16: computed "
        "in fp32, stored rounded to nearest even); grad_dtype is 0 fp32, 1 bf16, 2 fp16. If param_copy_ptr is not 0 the "
        "updated param, rounded to nearest even, is also written there as copy_dtype (1 bf16, 2 fp16; "
        "-1 with no copy). isa '' picks the best path, else one of supported_isas(). Returns the "
        "path that ran. Matches megazero.ops.adam.adam_update_reference; callers validate buffers.",
        py::arg("param_ptr"), py::arg("grad_ptr"), py::arg("exp_avg_ptr"), py::arg("exp_avg_sq_ptr"),
        py::arg("numel"), py::arg("grad_dtype"), py::arg("step"), py::arg("lr"), py::arg("beta1"),
        py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("decoupled"),
        py::arg("grad_scale"), py::arg("num_threads"), py::arg("param_copy_ptr") = 0,
        py::arg("copy_dtype") = kNone, py::arg("isa") = "", py::arg("exp_avg_dtype") = static_cast<int>(kFloat32),
        py::arg("exp_avg_sq_dtype") = static_cast<int>(kFloat32));
  m.def("supported_isas", &supported_isas,
        "The loop copies this CPU and build can run, best first: 'avx512', 'avx2', 'scalar'.");
  m.def("compiled_isas", [] {
          std::vector<std::string> names;
          for (const Isa& isa : isas()) names.push_back(isa.name);
          return names;
        },
        "The loop copies compiled into this build, whatever this CPU supports.");
  m.def("kernel_isa", [] { return std::string(choose_isa("").name); },
        "The path adam_update takes when none is forced: the first of supported_isas().");
  m.def("built_with_openmp", &megazero_cpu::built_with_openmp, "Whether the extension was compiled with OpenMP.");
}
