// Chooses the CPU kernel variant: the best the CPU supports, or the one named by the
// ATTENTION_EXT_CPU_ISA environment variable (avx512bf16 | avx512 | avx2 | generic), or set_cpu_variant().
#pragma once
#include <string>
#include <vector>

#include "kernel_table.h"

namespace attention_ext {
namespace cpu {

const KernelTable& active_kernels();
// Variants this build contains and this CPU can run, best first.
std::vector<std::string> supported_variants();
// Variants compiled into this build.
std::vector<std::string> compiled_variants();
// Selects a variant by name ("auto" = best supported); raises for unknown/unsupported names.
// Returns the name now active.
std::string set_variant(const std::string& name);
// The machine's float32 FMA peak in GFLOP/s as the active variant's widest vectors reach it: every
// torch thread runs fma_probe(iterations) at once (the benchmarks' "% of peak").
double fma_peak_gflops(int64_t iterations);

}  // namespace cpu
}  // namespace attention_ext
