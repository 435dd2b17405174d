// The avx512bf16 variant of the CPU kernels: the avx512 kernels plus, for bfloat16 inputs, a
// forward whose tile products use AVX512-BF16 dot products (forward_bf16_dot.inc). Only reached
// through kernels_avx512bf16(), which the dispatcher calls after checking the CPU.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <type_traits>

#include "../attention_geometry.h"
#include "../philox.h"
#include "kernel_table.h"

#if defined(__x86_64__) || defined(_M_X64)
// The intrinsics carry their own target attributes, so the header is included before the pragma.
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,avx512bf16,avx2,fma,f16c,bmi2")

namespace attention_ext {
namespace cpu {
namespace avx512bf16 {
#define ATTN_VEC_BYTES 64
#define ATTN_BF16_DOT 1
#include "attention_kernels.inc"
#undef ATTN_BF16_DOT
#undef ATTN_VEC_BYTES
}  // namespace avx512bf16
}  // namespace cpu
}  // namespace attention_ext

#pragma GCC pop_options

namespace attention_ext {
namespace cpu {
const KernelTable& kernels_avx512bf16() {
  static const KernelTable table = avx512bf16::make_table("avx512bf16");
  return table;
}
}  // namespace cpu
}  // namespace attention_ext
#endif
