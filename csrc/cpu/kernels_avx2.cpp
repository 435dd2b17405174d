// The avx2 variant of the CPU kernels: attention_kernels.inc compiled for 32-byte vectors.
// Only reached through kernels_avx2(), which the dispatcher calls after checking the CPU.
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
#pragma GCC target("avx2,fma,f16c,bmi2")

namespace attention_ext {
namespace cpu {
namespace avx2 {
#define ATTN_VEC_BYTES 32
#include "attention_kernels.inc"
#undef ATTN_VEC_BYTES
}  // namespace avx2
}  // namespace cpu
}  // namespace attention_ext

#pragma GCC pop_options

namespace attention_ext {
namespace cpu {
const KernelTable& kernels_avx2() {
  static const KernelTable table = avx2::make_table("avx2");
  return table;
}
}  // namespace cpu
}  // namespace attention_ext
#endif
