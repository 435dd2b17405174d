// The avx512bf16 variant of the CPU kernels' backward stage (see isa_begin.h).
#define ATTN_ISA_AVX512BF16 1
#define ATTN_STAGE backward
#include "../isa_begin.h"
#include "../backward_kernels.inc"
#include "../isa_end.h"
