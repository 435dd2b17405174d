// ATTN_ROUNDING_BARRIER(x): x as computed, hidden from the optimiser. A product passed through it is
// rounded on its own and never fused with the sum that follows into one multiply-add (the builds
// let GCC contract a·b + c). Code that must give the bits of a formula whose steps round one at a
// time uses it: the kernels' softmax, which scales scores as it reads them and must match the pass
// that stored the scaled tile, and the rotary op, which must match torch's elementwise ops.
//
// A macro, not a function: it expands under the instruction set of the code around it (a 512-bit
// vector in an AVX-512 variant, a scalar in the baseline build), where a function defined before a
// variant's `#pragma GCC target` would not take that target (csrc/cpu/isa_begin.h).
#pragma once

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
// "v": any SSE/AVX register the target has (xmm/ymm/zmm, 0-31 with AVX-512), scalars included.
#define ATTN_ROUNDING_BARRIER(x) asm("" : "+v"(x))
#elif defined(__GNUC__) && defined(__aarch64__)
#define ATTN_ROUNDING_BARRIER(x) asm("" : "+w"(x))
#else
// Elsewhere: through memory, which no contraction crosses.
#define ATTN_ROUNDING_BARRIER(x)     \
  do {                               \
    volatile auto attn_stored_ = (x); \
    (x) = attn_stored_;              \
  } while (0)
#endif
