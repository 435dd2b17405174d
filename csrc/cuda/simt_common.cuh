// Generic (SIMT) CUDA attention kernels for every dtype, head dim, stride, mask, causal kind and
// dropout setting, with the semantics of attention_semantics.h (as the CPU kernels): their tile
// shape and helpers. The kernels: simt_forward.cuh, simt_row_shift.cuh, simt_probabilities.cuh,
// simt_backward.cuh.
//
// Tiles: a CTA of 256 threads works on kBM = 32 query rows x kBN = 64 keys. In the "score
// layout" thread t owns query row r = t / 8 of the tile and the 8 keys 32h + 4g + e
// (g = t % 8, h in {0, 1}, e in {0..3}): the 8 threads of a row are 8 consecutive lanes, so row
// reductions are 3 xor-shuffles, and each thread's keys come in two aligned groups of 4, which is
// exactly one Philox draw each. Scores are reduced over the head dim in chunks of kKC = 32
// columns staged in shared memory (any d_k, no limit); outputs are produced in column chunks
// (kFwdOC / BwdCfg::kOC columns per CTA, the chunk index is part of the work item), so any d_v
// works with a fixed register budget; chunks past the first recompute the scores.
#pragma once
#include "common.cuh"
#include "kernels.h"

namespace attention_ext {
namespace cuda {
namespace simt {

constexpr int kThreads = 256;
constexpr int kBM = 32;   // query rows per tile
constexpr int kBN = 64;   // keys per tile
constexpr int kKC = 32;   // head-dim chunk of the score GEMMs
constexpr int kFwdOC = 64;  // output columns per forward CTA
constexpr int kLdC = kKC + 1;  // padded leading dims (bank conflicts)
constexpr int kLdS = kBN + 1;

template <typename A>
struct BwdCfg {
  static constexpr int kOC = sizeof(A) == 8 ? 32 : 64;  // output columns per backward CTA
};

// Loads rows x cols (rows < R valid rows, cols < C valid cols) of a strided storage tensor into a
// shared tile [R][ld], converting to A and zero-filling the rest. src points at element (0, 0).
template <int R, int C, typename T, typename A>
__device__ __forceinline__ void load_tile(A* dst, int ld, const T* src, int64_t rs, int64_t cs,
                                          int64_t rows, int64_t cols) {
  for (int e = threadIdx.x; e < R * C; e += kThreads) {
    const int r = e / C, c = e % C;
    A v = A(0);
    if (r < rows && c < cols) v = to_acc(src[static_cast<int64_t>(r) * rs + static_cast<int64_t>(c) * cs]);
    dst[r * ld + c] = v;
  }
}

// s[h*4+e] = sum_d X[x_row0 + r][d] · Y[y_row0 + 32h+4g+e][d] for d < D (score layout), X rows
// < x_rows and Y rows < y_rows valid (others contribute 0). Xs: [kBM][kLdC], Ys: [kBN][kLdC].
template <typename T, typename A>
__device__ __forceinline__ void tile_dot(A (&s)[8], A* Xs, A* Ys, const T* x, int64_t xrs, int64_t xcs,
                                         int64_t x_rows, const T* y, int64_t yrs, int64_t ycs,
                                         int64_t y_rows, int64_t D, int r, int g) {
#pragma unroll
  for (int t = 0; t < 8; ++t) s[t] = A(0);
  for (int64_t d0 = 0; d0 < D; d0 += kKC) {
    const int64_t dc = imin(kKC, D - d0);
    __syncthreads();
    load_tile<kBM, kKC>(Xs, kLdC, x + d0 * xcs, xrs, xcs, x_rows, dc);
    load_tile<kBN, kKC>(Ys, kLdC, y + d0 * ycs, yrs, ycs, y_rows, dc);
    __syncthreads();
    const A* xrow = Xs + r * kLdC;
#pragma unroll 4
    for (int d = 0; d < kKC; ++d) {
      const A xv = xrow[d];
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[h * 4 + e] += xv * Ys[(32 * h + 4 * g + e) * kLdC + d];
    }
  }
}

template <typename A>
__device__ __forceinline__ A row_max8(A v) {
  v = fmax(v, __shfl_xor_sync(0xFFFFFFFFu, v, 1));
  v = fmax(v, __shfl_xor_sync(0xFFFFFFFFu, v, 2));
  v = fmax(v, __shfl_xor_sync(0xFFFFFFFFu, v, 4));
  return v;
}
template <typename A>
__device__ __forceinline__ A row_sum8(A v) {
  v += __shfl_xor_sync(0xFFFFFFFFu, v, 1);
  v += __shfl_xor_sync(0xFFFFFFFFu, v, 2);
  v += __shfl_xor_sync(0xFFFFFFFFu, v, 4);
  return v;
}

// The log2-domain logits of a query tile (rows valid, starting at row i0; q points at it) against
// a key tile (cols valid, starting at key j0; k points at it) in the score layout: scaled, masked
// and visible as DevCtx::logit, -inf outside the tile. at: the batch position's terms. With dcap,
// the softcap's derivative of each logit goes there (DevCtx::logit).
template <typename T, typename A>
__device__ __forceinline__ void tile_logits(A (&s)[8], const AttentionParams& p, const DevCtx<T>& ctx, A* Xs,
                                            A* Ys, const T* q, int64_t i0, int64_t rows, const T* k,
                                            int64_t j0, int64_t cols, const BatchTerms<A>& at, int r, int g,
                                            A (*dcap)[8] = nullptr) {
  tile_dot(s, Xs, Ys, q, p.q.row_stride, p.q.col_stride, rows, k, p.k.row_stride, p.k.col_stride, cols,
           p.dk, r, g);
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int c = 32 * h + 4 * g + e;
      s[h * 4 + e] = ctx.logit(p, s[h * 4 + e], i0 + r, j0 + c, r < rows && c < cols, at,
                               dcap == nullptr ? nullptr : &(*dcap)[h * 4 + e]);
    }
}

}  // namespace simt
}  // namespace cuda
}  // namespace attention_ext
