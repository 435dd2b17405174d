// The avx512 variant of the CPU kernels: attention_kernels.inc compiled for 64-byte vectors.
// Only reached through kernels_avx512(), which the dispatcher calls after checking the CPU.
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
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,f16c,bmi2")

namespace attention_ext {
namespace cpu {
namespace avx512 {
#define ATTN_VEC_BYTES 64
#include "attention_kernels.inc"
#undef ATTN_VEC_BYTES
}  // namespace avx512
}  // namespace cpu
}  // namespace attention_ext

#pragma GCC pop_options

namespace attention_ext {
namespace cpu {
const KernelTable& kernels_avx512() {
  static const KernelTable table = avx512::make_table("avx512");
  return table;
}
}  // namespace cpu
}  // namespace attention_ext
#endif
