// Runtime choice among the loop copies a kernel is built with (AVX-512, AVX2, scalar), shared by
// the extensions in csrc/: what this CPU can run, best first, and picking one by name. The copies
// themselves are compiled per instruction set with target attributes, never -march=native.
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

namespace megazero_cpu {

struct CpuFeatures {
  bool avx2 = false;    // with FMA and F16C
  bool avx512 = false;  // F, BW and VL
};

// libgcc's __builtin_cpu_supports reads cpuid and also checks that the OS saves the wider registers.
inline CpuFeatures detect_features() {
  CpuFeatures f;
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  f.avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
  f.avx512 = f.avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl");
#endif
  return f;
}

// One compiled copy of a kernel: its name, its entry point(s) and whether this CPU can run it.
template <class Impl>
struct Isa {
  const char* name;
  Impl impl;
  bool supported;
};

// "" picks the best supported copy; a name forces that copy, which must be supported here.
template <class Impl>
const Isa<Impl>& choose_isa(const std::vector<Isa<Impl>>& isas, const std::string& name,
                            const char* who) {
  for (const auto& isa : isas)
    if (isa.supported && (name.empty() || name == isa.name)) return isa;
  std::string known;
  for (const auto& isa : isas)
    if (isa.supported) known += std::string(known.empty() ? "" : ", ") + isa.name;
  throw std::invalid_argument(std::string(who) + ": instruction set '" + name +
                              "' is not available on this CPU/build; available: " + known);
}

template <class Impl>
std::vector<std::string> supported_names(const std::vector<Isa<Impl>>& isas) {
  std::vector<std::string> names;
  for (const auto& isa : isas)
    if (isa.supported) names.push_back(isa.name);
  return names;
}

inline bool built_with_openmp() {
#ifdef _OPENMP
  return true;
#else
  return false;
#endif
}

}  // namespace megazero_cpu
