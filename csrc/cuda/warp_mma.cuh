// The sm_80+ instructions the tensor-core kernels are built from, one wrapper each:
//   mma_m16n8k16<T>   D(16x8, fp32) += A(16x16, T) · B(16x8, T), warp-wide (mma.sync)
//   ldmatrix_x4[_trans]  four 8x8 16-bit matrices from shared memory into mma fragments
//   cp_async_16       a 16-byte global -> shared copy that bypasses registers (cp.async.cg),
//                     zero-filling instead of reading when the source row is out of range
//   cp_async_commit / cp_async_wait<N>  close a group of copies / wait until at most N are open
//
// Fragment layouts (PTX ISA, "Matrix fragments for mma.m16n8k16"): lane = 4 * g + t. A: register
// r holds the two consecutive elements (g + 8 * (r & 1), 2t + 8 * (r >> 1) + {0, 1}); B (k x n,
// "col"): register r holds (2t + 8r + {0, 1}, g); C/D: element e is (g + 8 * (e >> 1), 2t + (e & 1)).
// ldmatrix: lane l gives the address of row l % 8 of matrix l / 8; register i receives, from
// matrix i, row g, columns 2t, 2t + 1 (.trans: rows 2t, 2t + 1 of column g).
//
// In ATTN_CUDA_EMULATION builds every wrapper forwards to its host emulation (../cuda_emulation/emulation.h), which
// implements these layouts as exchanges between the 32 lanes of a warp, so the tensor-core kernels
// run, and are tested, without a GPU.
#pragma once
#include <string.h>

#include "common.cuh"

namespace attention_ext {
namespace cuda {
namespace tc {

template <typename T>
struct MmaType;
template <>
struct MmaType<__half> {
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    uint32_t bits;
    memcpy(&bits, &h, sizeof(bits));
    return bits;
  }
};
template <>
struct MmaType<__nv_bfloat16> {
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    uint32_t bits;
    memcpy(&bits, &h, sizeof(bits));
    return bits;
  }
};

#if defined(ATTN_CUDA_EMULATION)

template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  cuda_emulation::mma_m16n8k16<T>(d, a, b0, b1);
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
  cuda_emulation::ldmatrix_x4(r, row, false);
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
  cuda_emulation::ldmatrix_x4(r, row, true);
}
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool in_range) {
  cuda_emulation::cp_async_16(dst, src, in_range);
}
__device__ __forceinline__ void cp_async_commit() { cuda_emulation::cp_async_commit(); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  cuda_emulation::cp_async_wait(N);
}

#else

// Below sm_80 none of these exist; eligible() keeps the tensor-core kernels from launching there.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define ATTN_SM80_ONLY(...) __trap()
#else
#define ATTN_SM80_ONLY(...) __VA_ARGS__
#endif

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma_m16n8k16<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                     uint32_t b1) {
  ATTN_SM80_ONLY(asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1)));
}
template <>
__device__ __forceinline__ void mma_m16n8k16<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                            uint32_t b1) {
  ATTN_SM80_ONLY(asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1)));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
  ATTN_SM80_ONLY(asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                              : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                              : "r"(shared_address(row))));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
  ATTN_SM80_ONLY(asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                              : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                              : "r"(shared_address(row))));
}

// src-size 0 reads nothing and writes 16 zero bytes (src must still be a valid address).
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool in_range) {
  ATTN_SM80_ONLY(asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(dst)),
                              "l"(src), "r"(in_range ? 16 : 0)
                              : "memory"));
}
__device__ __forceinline__ void cp_async_commit() {
  ATTN_SM80_ONLY(asm volatile("cp.async.commit_group;\n" ::: "memory"));
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  ATTN_SM80_ONLY(asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"));
}

#undef ATTN_SM80_ONLY

#endif  // ATTN_CUDA_EMULATION

}  // namespace tc
}  // namespace cuda
}  // namespace attention_ext
