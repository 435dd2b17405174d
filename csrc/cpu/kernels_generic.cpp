// The generic variant of the CPU kernels: attention_kernels.inc compiled for 16-byte vectors.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <type_traits>

#include "../attention_geometry.h"
#include "../philox.h"
#include "kernel_table.h"

namespace attention_ext {
namespace cpu {
namespace generic {
#define ATTN_VEC_BYTES 16
#include "attention_kernels.inc"
#undef ATTN_VEC_BYTES
}  // namespace generic

const KernelTable& kernels_generic() {
  static const KernelTable table = generic::make_table("generic");
  return table;
}
}  // namespace cpu
}  // namespace attention_ext
