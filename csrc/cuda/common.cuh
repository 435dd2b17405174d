// Device helpers shared by the CUDA attention kernels: storage <-> accumulator conversions, the
// per-call constants and the logit of one score (by the rules of attention_semantics.h and
// attention_geometry.h, shared with the CPU kernels), and the dropout stream. No torch headers:
// kernels see only AttentionParams.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "../attention_geometry.h"
#include "../attention_params.h"
#include "../attention_semantics.h"
#include "../philox.h"

// Kernel launches and dynamic shared memory are spelled through these two macros so that the
// host emulation (../cuda_emulation/emulation.h, ATTN_CUDA_EMULATION builds) can give them a host meaning.
#ifndef ATTN_LAUNCH
#define ATTN_LAUNCH(kernel, grid, block, smem, stream) kernel<<<grid, block, smem, stream>>>
#endif
#ifndef ATTN_DYNAMIC_SHARED
#define ATTN_DYNAMIC_SHARED(name) extern __shared__ __align__(16) unsigned char name[]
#endif

namespace attention_ext {
namespace cuda {

// ---------------------------------------------------------------------------------------------
// Storage types. Accumulation: AccOf (attention_semantics.h), as on the CPU.

__device__ __forceinline__ double to_acc(double x) { return x; }
__device__ __forceinline__ float to_acc(float x) { return x; }
__device__ __forceinline__ float to_acc(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 x) { return __bfloat162float(x); }

// Round to nearest even, like the CPU's from_acc.
__device__ __forceinline__ void store_acc(double x, double* dst) { *dst = x; }
__device__ __forceinline__ void store_acc(float x, float* dst) { *dst = x; }
__device__ __forceinline__ void store_acc(float x, __half* dst) { *dst = __float2half_rn(x); }
__device__ __forceinline__ void store_acc(float x, __nv_bfloat16* dst) { *dst = __float2bfloat16_rn(x); }

// Two consecutive outputs c, c + 1 of a row: one 32-bit store for fp16/bf16 when the columns are
// contiguous and the pair is 4-byte aligned (the tensor-core epilogues' case), else two stores.
__device__ __forceinline__ void store_acc2(float a, float b, __half* dst, int64_t col_stride) {
  if (col_stride == 1 && (reinterpret_cast<uintptr_t>(dst) & 3) == 0) {
    *reinterpret_cast<__half2*>(dst) = __floats2half2_rn(a, b);
  } else {
    store_acc(a, dst);
    store_acc(b, dst + col_stride);
  }
}
__device__ __forceinline__ void store_acc2(float a, float b, __nv_bfloat16* dst, int64_t col_stride) {
  if (col_stride == 1 && (reinterpret_cast<uintptr_t>(dst) & 3) == 0) {
    *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(a, b);
  } else {
    store_acc(a, dst);
    store_acc(b, dst + col_stride);
  }
}

// ---------------------------------------------------------------------------------------------
// Per-call constants every tile needs.

// What a batch position brings to the logit pipeline: its mask offset and its ALiBi slope
// (times log2 e; 0 without ALiBi). DevCtx::terms makes it once per work item.
template <typename A>
struct BatchTerms {
  int64_t mask_base;
  A alibi;
};

template <typename T>
struct DevCtx {
  using A = typename AccOf<T>::type;
  A scale_log2;    // scale * log2(e)
  A softcap_log2;  // softcap * log2(e); 0: no softcap
  A inv_keep;      // 1 / (1 - p)
  A mask_lowest;  // lowest_finite(dtype): additive-mask entries at or below it mask the key
  uint64_t seed, offset;
  int64_t dropout_row_base;
  bool dropout;

  __device__ explicit DevCtx(const AttentionParams& p)
      : scale_log2(static_cast<A>(p.scale * kLog2e)),
        softcap_log2(static_cast<A>(p.softcap * kLog2e)),
        inv_keep(static_cast<A>(1.0 / (1.0 - p.dropout_p))),
        mask_lowest(static_cast<A>(lowest_finite(p.dtype))),
        seed(p.seed),
        offset(p.offset),
        dropout_row_base(p.dropout_row_base),
        dropout(p.dropout_p > 0.0) {
    if (dropout && p.rng_state_device != nullptr) {
      seed = static_cast<uint64_t>(p.rng_state_device[0]);
      offset = static_cast<uint64_t>(p.rng_state_device[1]);
    }
  }

  __device__ __forceinline__ BatchTerms<A> terms(const AttentionParams& p, const int64_t* idx) const {
    return {p.mask_kind == MaskKind::kNone ? 0 : batch_offset(p, p.mask, idx), alibi_slope_log2<A>(p, idx)};
  }

  // Scaled, modified (softcap, ALiBi), masked logit in log2 units of raw score s at (row i, key j)
  // of the batch position `at`. valid = i < n && j < m; invalid entries become -inf. With dcap and
  // a softcap, *dcap receives the softcap's derivative (the backward's chain rule for dQ, dK).
  __device__ __forceinline__ A logit(const AttentionParams& p, A s, int64_t i, int64_t j, bool valid,
                                     const BatchTerms<A>& at, A* dcap = nullptr) const {
    if (!valid) return neg_inf<A>();
    A x = scaled_logit(s, scale_log2);
    if (softcap_log2 != A(0)) {
      x = softcapped_logit(x, softcap_log2);
      if (dcap != nullptr) *dcap = softcap_derivative(x, softcap_log2);
    }
    if (at.alibi != A(0)) x += alibi_bias(at.alibi, i, j, p.m - p.n);
    if (p.mask_kind == MaskKind::kAdditive) {
      const T* mask = static_cast<const T*>(p.mask.data);
      x = with_additive_mask(x, to_acc(mask[at.mask_base + i * p.mask.row_stride + j * p.mask.col_stride]),
                             mask_lowest);
    } else if (p.mask_kind == MaskKind::kBool) {
      const uint8_t* mask = static_cast<const uint8_t*>(p.mask.data);
      if (!mask[at.mask_base + i * p.mask.row_stride + j * p.mask.col_stride]) x = neg_inf<A>();
    }
    if (has_band(p) && !key_visible(p, i, j)) x = neg_inf<A>();
    return x;
  }

  // Keep flags for keys [j4, j4 + 4) (j4 a multiple of 4) of row i, batch position b.
  __device__ __forceinline__ PhiloxWords words(int64_t b, int64_t i, int64_t j4) const {
    return dropout_words(seed, offset, static_cast<uint64_t>(b), static_cast<uint64_t>(dropout_row_base + i),
                         static_cast<uint64_t>(j4));
  }
};

// Word i (0..3, known only at run time) of a Philox draw, by selects: indexing the array with a
// run-time value would put it in local memory.
__device__ __forceinline__ uint32_t philox_word(const PhiloxWords& w, int i) {
  return (i & 2) ? ((i & 1) ? w.w[3] : w.w[2]) : ((i & 1) ? w.w[1] : w.w[0]);
}

// Dynamic shared memory above the default 48 KiB needs an opt-in per kernel.
template <typename Kernel>
inline cudaError_t prepare_smem(Kernel kernel, size_t bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(bytes));
}

inline unsigned grid_for(int64_t items) {
  return static_cast<unsigned>(imin(items, 0x7FFFFFFF));
}

}  // namespace cuda
}  // namespace attention_ext
