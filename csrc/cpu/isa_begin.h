// Opens one instruction-set variant of the CPU kernels in a translation unit. A variant's stage is
//   #define ATTN_ISA_AVX512 1               (or ATTN_ISA_AMX, ATTN_ISA_AVX512BF16, ATTN_ISA_AVX2, ATTN_ISA_GENERIC)
//   #define ATTN_STAGE forward              (or backward)
//   #include "../isa_begin.h"
//   #include "../forward_kernels.inc"       (or backward_kernels.inc)
//   #include "../isa_end.h"
// (csrc/cpu/variants/<isa>_<stage>.cpp), so touching one stage recompiles that stage's variants
// (five of each) and nothing else. This header includes what the kernels need, then sets the target
// ISA (#pragma GCC target), the vector width ATTN_VEC_BYTES (64 AVX-512, 32 AVX2, 16 SSE2/NEON)
// and the namespace attention_ext::cpu::<isa>. Everything a stage defines is static or in that
// namespace and no header template is instantiated under the pragma for the first time, so no
// wide-ISA code leaks into a symbol the linker might share with the generic build. A variant is
// only reached through its table (cpu_dispatch.cpp), after the CPU is checked for its ISA.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <memory>
#include <type_traits>
#include <utility>

#include "../attention_semantics.h"
#include "../philox.h"
#include "../rounding_barrier.h"
#include "kernel_table.h"
#include "scratch_arena.h"

#if defined(ATTN_ISA_AMX) || defined(ATTN_ISA_AVX512BF16) || defined(ATTN_ISA_AVX512) || defined(ATTN_ISA_AVX2)
#if !(defined(__x86_64__) || defined(_M_X64))
#define ATTN_ISA_SKIP 1  // an x86 variant in a build for another architecture: compiles to nothing
#elif defined(ATTN_ISA_AMX) && !defined(ATTN_AMX_COMPILED)
#define ATTN_ISA_SKIP 1  // a compiler or OS without AMX support (kernel_table.h): compiles to nothing
#else
// The intrinsics carry their own target attributes, so the header is included before the pragma.
#include <immintrin.h>
#endif
#endif

#if defined(ATTN_ISA_SKIP)
#define ATTN_ISA_NAMESPACE unused_variant
#elif defined(ATTN_ISA_AMX)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,avx512bf16,amx-tile,amx-bf16,avx2,fma,f16c,bmi2")
#define ATTN_ISA_PUSHED 1
#define ATTN_VEC_BYTES 64
#define ATTN_BF16_AMX 1  // the bf16 forward's and backward's tile products on AMX tiles
#define ATTN_ISA_NAMESPACE amx
#elif defined(ATTN_ISA_AVX512BF16)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,avx512bf16,avx2,fma,f16c,bmi2")
#define ATTN_ISA_PUSHED 1
#define ATTN_VEC_BYTES 64
#define ATTN_BF16_DOT 1  // the bf16 forward's and backward's tile products as AVX512-BF16 dot products
#define ATTN_ISA_NAMESPACE avx512bf16
#elif defined(ATTN_ISA_AVX512)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,f16c,bmi2")
#define ATTN_ISA_PUSHED 1
#define ATTN_VEC_BYTES 64
#define ATTN_ISA_NAMESPACE avx512
#elif defined(ATTN_ISA_AVX2)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi2")
#define ATTN_ISA_PUSHED 1
#define ATTN_VEC_BYTES 32
#define ATTN_ISA_NAMESPACE avx2
#elif defined(ATTN_ISA_GENERIC)
#define ATTN_VEC_BYTES 16
#define ATTN_ISA_NAMESPACE generic
#else
#error "define one of ATTN_ISA_AMX, ATTN_ISA_AVX512BF16, ATTN_ISA_AVX512, ATTN_ISA_AVX2, ATTN_ISA_GENERIC before isa_begin.h"
#endif

#if !defined(ATTN_ISA_SKIP)
namespace attention_ext {
namespace cpu {
namespace ATTN_ISA_NAMESPACE {
#endif
