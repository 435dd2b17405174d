// The avx512 variant of the CPU kernels' forward stage (see isa_begin.h).
#define ATTN_ISA_AVX512 1
#define ATTN_STAGE forward
#include "../isa_begin.h"
#include "../forward_kernels.inc"
#include "../isa_end.h"
