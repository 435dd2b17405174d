// The amx variant of the CPU kernels' forward stage (see isa_begin.h).
#define ATTN_ISA_AMX 1
#define ATTN_STAGE forward
#include "../isa_begin.h"
#include "../forward_kernels.inc"
#include "../isa_end.h"
