// Chooses the CPU kernel variant: the preferred one the CPU supports (auto_variant), or the one named by the
// ATTENTION_EXT_CPU_ISA environment variable (amx | avx512bf16 | avx512 | avx2 | generic), or set_cpu_variant().
#pragma once
#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

#include "kernel_table.h"

namespace attention_ext {
namespace cpu {

const KernelTable& active_kernels();
// Variants this build contains and this CPU can run, in order of preference.
std::vector<std::string> supported_variants();
// The variant "auto" selects on this CPU: the first supported one that is also preferred here
// (amx wherever the CPU has it; else avx512bf16 only on AMD's cores, where its bf16 dot products
// outrun the FMAs).
std::string auto_variant();
// Variants compiled into this build.
std::vector<std::string> compiled_variants();
// Selects a variant by name ("auto" = auto_variant()); raises for unknown/unsupported names.
// Returns the name now active.
std::string set_variant(const std::string& name);
// The machine's float32 FMA peak in GFLOP/s as the active variant's widest vectors reach it: every
// torch thread runs fma_probe(iterations) at once (the benchmarks' "% of peak").
double fma_peak_gflops(int64_t iterations);
// The same for the kernels' own tile GEMM on cache-resident tiles (tile_gemm_probe): the ceiling the
// attention kernels' GEMMs reach on this machine, reported beside the FMA peak.
double tile_gemm_gflops(int64_t iterations);
// The same for the fp32 forward's per-tile work, both GEMMs and the online-softmax step
// (tile_forward_probe): the ceiling of the forward's rate on this machine, reported beside the two.
double tile_forward_gflops(int64_t iterations);
// The same for the fp32 backward's per-tile work, its five products and the P/dS pass
// (tile_backward_probe): the ceiling of the backward's rate on this machine.
double tile_backward_gflops(int64_t iterations);
// The streaming read bandwidth in GB/s: every torch thread sums its contiguous share of `buffer`
// (float32, far larger than the caches for a memory figure) once, as 8 parts read side by side.
double stream_read_gbps(const at::Tensor& buffer);

}  // namespace cpu
}  // namespace attention_ext
