// Generic (SIMT) CUDA attention kernels for every dtype, head dim, stride, mask, causal kind and
// dropout setting: the exact semantics of csrc/cpu/attention_kernels.inc.
//
// Tiles: a CTA of 256 threads works on kBM = 32 query rows x kBN = 64 keys. In the "score
// layout" thread t owns query row r = t / 8 of the tile and the 8 keys 32h + 4g + e
// (g = t % 8, h in {0, 1}, e in {0..3}): the 8 threads of a row are 8 consecutive lanes, so row
// reductions are 3 xor-shuffles, and each thread's keys come in two aligned groups of 4, which is
// exactly one Philox draw each. Scores are reduced over the head dim in chunks of kKC = 32
// columns staged in shared memory (any d_k, no limit); outputs are produced in column chunks
// (kFwdOC / BwdCfg::kOC columns per CTA, the chunk index is part of the work item), so any d_v
// works with a fixed register budget; chunks past the first recompute the scores.
//
// Forward:  item = (batch index, query tile, d_v chunk); online softmax in log2 units as on the
//           CPU; the d_v-chunk-0 CTA writes lse.
// Backward (deterministic, no atomics, same ownership as the CPU):
//   delta:  one thread per query row: rowsum(dO ∘ O) − dlse, in the column order of dP.
//   kv:     item = (K owner, key tile, column chunk); loops over the broadcast batch positions of
//           K/V and the query tiles; dV += (P∘Z)ᵀ dO, dK += dSᵀ Q (· scale at the end).
//   q:      item = (Q owner, query tile, column chunk); loops over broadcast positions and key
//           tiles; dQ += dS K (· scale).
//   mask:   item = (mask owner, mask row tile, mask key tile (or all when the mask broadcasts over
//           keys)); sums dS over broadcast positions, then over broadcast rows/cols in a fixed
//           order through shared memory.
// Row shift: item = (batch index, query tile): the exact softmax shift of rows whose lse is too
//           large in magnitude to rebuild P from (as the CPU's row_shift); run before the
//           backward passes and the probabilities.
// Probabilities: item = (batch index, query tile, key tile): P = 2^((s − shift_hi) − shift_lo).
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
// and causal as DevCtx::logit, -inf outside the tile. mask_base: the batch position's mask offset.
template <typename T, typename A>
__device__ __forceinline__ void tile_logits(A (&s)[8], const AttentionParams& p, const DevCtx<T>& ctx, A* Xs,
                                            A* Ys, const T* q, int64_t i0, int64_t rows, const T* k,
                                            int64_t j0, int64_t cols, int64_t mask_base, int r, int g) {
  tile_dot(s, Xs, Ys, q, p.q.row_stride, p.q.col_stride, rows, k, p.k.row_stride, p.k.col_stride, cols,
           p.dk, r, g);
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int c = 32 * h + 4 * g + e;
      s[h * 4 + e] = ctx.logit(p, s[h * 4 + e], i0 + r, j0 + c, r < rows && c < cols, mask_base);
    }
}

// ---------------------------------------------------------------------------------------------
// Forward.

template <typename A>
constexpr size_t forward_smem() {
  return sizeof(A) * (kBM * kLdC + kBN * kLdC + kBM * kLdS + kBN * kFwdOC);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) forward_kernel(const __grid_constant__ AttentionParams p,
                                                           int64_t total) {
  using A = typename AccOf<T>::type;
  ATTN_DYNAMIC_SHARED(smem_raw);
  A* Qs = reinterpret_cast<A*>(smem_raw);
  A* Ks = Qs + kBM * kLdC;
  A* Ps = Ks + kBN * kLdC;
  A* Vs = Ps + kBM * kLdS;
  const int tid = threadIdx.x, r = tid >> 3, g = tid & 7;
  const DevCtx<T> ctx(p);
  const int64_t n_qt = ceil_div(p.n, kBM);
  const int64_t n_oc = imax(1, ceil_div(p.dv, kFwdOC));
  const A ninf = neg_inf<A>();

  for (int64_t item = blockIdx.x; item < total; item += gridDim.x) {
    const int64_t oc = item % n_oc;
    const int64_t qt = (item / n_oc) % n_qt;
    const int64_t b = item / (n_oc * n_qt);
    int64_t idx[kMaxBatchDims];
    unravel_batch(p, b, idx);
    const int64_t i0 = qt * kBM;
    const int64_t rows = imin(kBM, p.n - i0);
    const int64_t i = i0 + r;  // this thread's query row
    const int64_t c0 = oc * kFwdOC;
    const int64_t ocols = imax(0, imin(kFwdOC, p.dv - c0));
    const T* q = static_cast<const T*>(p.q.data) + batch_offset(p, p.q, idx) + i0 * p.q.row_stride;
    const T* k = static_cast<const T*>(p.k.data) + batch_offset(p, p.k, idx);
    const T* v = static_cast<const T*>(p.v.data) + batch_offset(p, p.v, idx) + c0 * p.v.col_stride;
    const int64_t mask_base = p.mask_kind == MaskKind::kNone ? 0 : batch_offset(p, p.mask, idx);

    A m_run = ninf, l_run = A(0);
    A o[8];
#pragma unroll
    for (int t = 0; t < 8; ++t) o[t] = A(0);

    const int64_t key_end = visible_key_end(p, i0, rows);
    for (int64_t j0 = 0; j0 < key_end; j0 += kBN) {
      const int64_t cols = imin(kBN, p.m - j0);
      A s[8];
      tile_logits(s, p, ctx, Qs, Ks, q, i0, rows, k + j0 * p.k.row_stride, j0, cols, mask_base, r, g);
      A tile_max = ninf;
#pragma unroll
      for (int t = 0; t < 8; ++t) tile_max = fmax(tile_max, s[t]);
      tile_max = row_max8(tile_max);
      const A m_new = fmax(m_run, tile_max);
      // Nothing visible yet in this row (m_new = -inf): shift 0, so masked keys give 0 and NaN
      // scores (which fmax skips) give NaN, which then reaches the row's sum and output.
      const A shift = m_new == ninf ? A(0) : m_new;
      A psum = A(0);
#pragma unroll
      for (int t = 0; t < 8; ++t) {
        s[t] = exp2_acc(s[t] - shift);
        psum += s[t];
      }
      psum = row_sum8(psum);
      if (m_new != ninf) {
        const A alpha = m_run == ninf ? A(0) : exp2_acc(m_run - m_new);
        if (m_new != m_run) {
          l_run *= alpha;
#pragma unroll
          for (int t = 0; t < 8; ++t) o[t] *= alpha;
        }
        m_run = m_new;
      }
      l_run += psum;
      if (ctx.dropout) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const PhiloxWords w = ctx.words(b, i, j0 + 32 * h + 4 * g);
#pragma unroll
          for (int e = 0; e < 4; ++e)
            s[h * 4 + e] = w.w[e] >= p.dropout_threshold ? s[h * 4 + e] * ctx.inv_keep : A(0);
        }
      }
      if (ocols > 0) {
        __syncthreads();  // Ps / Vs free (previous tile's P·V done)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int e = 0; e < 4; ++e) Ps[r * kLdS + 32 * h + 4 * g + e] = s[h * 4 + e];
        load_tile<kBN, kFwdOC>(Vs, kFwdOC, v + j0 * p.v.row_stride, p.v.row_stride, p.v.col_stride,
                               cols, ocols);
        __syncthreads();
        const A* prow = Ps + r * kLdS;
#pragma unroll 4
        for (int jj = 0; jj < kBN; ++jj) {
          const A pj = prow[jj];
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[h * 4 + e] += pj * Vs[jj * kFwdOC + 32 * h + 4 * g + e];
        }
      }
    }

    if (r < rows) {
      const A inv = inverse_row_sum(l_run);
      T* out = static_cast<T*>(p.out.data) + batch_offset(p, p.out, idx) + i * p.out.row_stride;
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int c = 32 * h + 4 * g + e;
          if (c < ocols) store_acc(static_cast<A>(o[h * 4 + e] * inv), out + (c0 + c) * p.out.col_stride);
        }
      if (oc == 0 && g == 0) {
        A* lse = static_cast<A*>(p.lse.data) + batch_offset(p, p.lse, idx);
        lse[i * p.lse.row_stride] = row_lse(m_run, l_run);
      }
    }
  }
}

template <typename T>
cudaError_t launch_forward(const AttentionParams& p, cudaStream_t stream) {
  using A = typename AccOf<T>::type;
  const int64_t total = p.batch_numel * ceil_div(p.n, kBM) * imax(1, ceil_div(p.dv, kFwdOC));
  if (total <= 0) return cudaSuccess;
  constexpr size_t smem = forward_smem<A>();
  cudaError_t err = prepare_smem(forward_kernel<T>, smem);
  if (err != cudaSuccess) return err;
  ATTN_LAUNCH(forward_kernel<T>, grid_for(total), kThreads, smem, stream)(p, total);
  return cudaGetLastError();
}

// ---------------------------------------------------------------------------------------------
// Row shift.

// Softmax shift of each row (AttentionParams::shift_hi / shift_lo), as the CPU's row_shift:
// shift_hi = lse·log2(e), shift_lo = 0, except for rows whose |lse·log2(e)| passes
// needs_exact_shift (attention_geometry.h), where lse = max + log(sum) has rounded log(sum) away (e.g. −1e9
// biases): there the exact row max and log2(sum) are recomputed from S in two passes over the
// visible keys. item = (batch index, query tile); the recomputation runs only for tiles with
// such a row (a CTA-uniform decision, since tile_dot synchronises the CTA).
template <typename A>
constexpr size_t row_shift_smem() {
  return sizeof(A) * (kBM * kLdC + kBN * kLdC) + 16;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) row_shift_kernel(const __grid_constant__ AttentionParams p,
                                                             int64_t total) {
  using A = typename AccOf<T>::type;
  ATTN_DYNAMIC_SHARED(smem_raw);
  A* Qs = reinterpret_cast<A*>(smem_raw);
  A* Ks = Qs + kBM * kLdC;
  int* any_large = reinterpret_cast<int*>(Ks + kBN * kLdC);
  const int tid = threadIdx.x, r = tid >> 3, g = tid & 7;
  const DevCtx<T> ctx(p);
  const int64_t n_qt = ceil_div(p.n, kBM);
  const A ninf = neg_inf<A>();
  for (int64_t item = blockIdx.x; item < total; item += gridDim.x) {
    const int64_t qt = item % n_qt;
    const int64_t b = item / n_qt;
    int64_t idx[kMaxBatchDims];
    unravel_batch(p, b, idx);
    const int64_t i0 = qt * kBM;
    const int64_t rows = imin(kBM, p.n - i0);
    const int64_t i = i0 + r;
    A* hi = static_cast<A*>(p.shift_hi.data) + batch_offset(p, p.shift_hi, idx);
    A* lo = static_cast<A*>(p.shift_lo.data) + batch_offset(p, p.shift_lo, idx);
    A l2 = ninf;
    if (r < rows) l2 = static_cast<const A*>(p.lse.data)[batch_offset(p, p.lse, idx) + i * p.lse.row_stride] *
                       static_cast<A>(kLog2e);
    const bool large = r < rows && needs_exact_shift(l2);
    if (r < rows && g == 0) {
      hi[i * p.shift_hi.row_stride] = l2;
      lo[i * p.shift_lo.row_stride] = A(0);
    }
    __syncthreads();  // the previous item is done with any_large
    if (tid == 0) *any_large = 0;
    __syncthreads();
    if (large) *any_large = 1;
    __syncthreads();
    if (*any_large == 0) continue;

    const T* q = static_cast<const T*>(p.q.data) + batch_offset(p, p.q, idx) + i0 * p.q.row_stride;
    const T* k = static_cast<const T*>(p.k.data) + batch_offset(p, p.k, idx);
    const int64_t mask_base = p.mask_kind == MaskKind::kNone ? 0 : batch_offset(p, p.mask, idx);
    const int64_t key_end = visible_key_end(p, i0, rows);
    A row_max = ninf, row_sum = A(0);
    for (int pass = 0; pass < 2; ++pass) {
      for (int64_t j0 = 0; j0 < key_end; j0 += kBN) {
        const int64_t cols = imin(kBN, p.m - j0);
        A s[8];
        tile_logits(s, p, ctx, Qs, Ks, q, i0, rows, k + j0 * p.k.row_stride, j0, cols, mask_base, r, g);
        A part = pass == 0 ? ninf : A(0);
#pragma unroll
        for (int t = 0; t < 8; ++t) {
          if (pass == 0) part = fmax(part, s[t]);
          else if (row_max != ninf) part += exp2_acc(s[t] - row_max);
        }
        if (pass == 0) row_max = fmax(row_max, row_max8(part));
        else row_sum += row_sum8(part);
      }
    }
    if (large && g == 0 && row_max != ninf && row_sum > A(0)) {
      hi[i * p.shift_hi.row_stride] = row_max;
      lo[i * p.shift_lo.row_stride] = log2_acc(row_sum);
    }
  }
}

template <typename T>
cudaError_t launch_row_shift(const AttentionParams& p, cudaStream_t stream) {
  using A = typename AccOf<T>::type;
  const int64_t total = p.batch_numel * ceil_div(p.n, kBM);
  if (total <= 0) return cudaSuccess;
  constexpr size_t smem = row_shift_smem<A>();
  cudaError_t err = prepare_smem(row_shift_kernel<T>, smem);
  if (err != cudaSuccess) return err;
  ATTN_LAUNCH(row_shift_kernel<T>, grid_for(total), kThreads, smem, stream)(p, total);
  return cudaGetLastError();
}

// ---------------------------------------------------------------------------------------------
// Attention probabilities from a saved lse.

template <typename A>
constexpr size_t probs_smem() {
  return sizeof(A) * (kBM * kLdC + kBN * kLdC);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) probs_kernel(const __grid_constant__ AttentionParams p,
                                                         int64_t total) {
  using A = typename AccOf<T>::type;
  ATTN_DYNAMIC_SHARED(smem_raw);
  A* Qs = reinterpret_cast<A*>(smem_raw);
  A* Ks = Qs + kBM * kLdC;
  const int tid = threadIdx.x, r = tid >> 3, g = tid & 7;
  const DevCtx<T> ctx(p);
  const int64_t n_qt = ceil_div(p.n, kBM), n_kt = ceil_div(p.m, kBN);
  const A ninf = neg_inf<A>();
  for (int64_t item = blockIdx.x; item < total; item += gridDim.x) {
    const int64_t kt = item % n_kt;
    const int64_t qt = (item / n_kt) % n_qt;
    const int64_t b = item / (n_kt * n_qt);
    int64_t idx[kMaxBatchDims];
    unravel_batch(p, b, idx);
    const int64_t i0 = qt * kBM, j0 = kt * kBN;
    const int64_t rows = imin(kBM, p.n - i0), cols = imin(kBN, p.m - j0);
    const int64_t i = i0 + r;
    A s[8];
    if (j0 < visible_key_end(p, i0, rows)) {  // uniform over the CTA
      const T* q = static_cast<const T*>(p.q.data) + batch_offset(p, p.q, idx) + i0 * p.q.row_stride;
      const T* k = static_cast<const T*>(p.k.data) + batch_offset(p, p.k, idx) + j0 * p.k.row_stride;
      const int64_t mask_base = p.mask_kind == MaskKind::kNone ? 0 : batch_offset(p, p.mask, idx);
      tile_logits(s, p, ctx, Qs, Ks, q, i0, rows, k, j0, cols, mask_base, r, g);
      const A* shift_hi = static_cast<const A*>(p.shift_hi.data) + batch_offset(p, p.shift_hi, idx);
      const A* shift_lo = static_cast<const A*>(p.shift_lo.data) + batch_offset(p, p.shift_lo, idx);
      const A hi = r < rows ? shift_hi[i * p.shift_hi.row_stride] : ninf;
      const A lo = r < rows ? shift_lo[i * p.shift_lo.row_stride] : A(0);
#pragma unroll
      for (int t = 0; t < 8; ++t) s[t] = hi == ninf ? A(0) : exp2_acc((s[t] - hi) - lo);
    } else {
#pragma unroll
      for (int t = 0; t < 8; ++t) s[t] = A(0);
    }
    if (r < rows) {
      T* out = static_cast<T*>(p.probs.data) + batch_offset(p, p.probs, idx) + i * p.probs.row_stride;
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int c = 32 * h + 4 * g + e;
          if (c < cols) store_acc(s[h * 4 + e], out + (j0 + c) * p.probs.col_stride);
        }
    }
  }
}

template <typename T>
cudaError_t launch_probs(const AttentionParams& p, cudaStream_t stream) {
  using A = typename AccOf<T>::type;
  const int64_t total = p.batch_numel * ceil_div(p.n, kBM) * ceil_div(p.m, kBN);
  if (total <= 0) return cudaSuccess;
  constexpr size_t smem = probs_smem<A>();
  cudaError_t err = launch_row_shift<T>(p, stream);
  if (err != cudaSuccess) return err;
  if ((err = prepare_smem(probs_kernel<T>, smem)) != cudaSuccess) return err;
  ATTN_LAUNCH(probs_kernel<T>, grid_for(total), kThreads, smem, stream)(p, total);
  return cudaGetLastError();
}

// ---------------------------------------------------------------------------------------------
// Backward: delta = rowsum(dO ∘ O) − dlse, one thread per query row, summed in column order:
// the order in which tile_dot sums dP = dO Vᵀ, so that where P is one-hot (huge scores) the
// output row is that V row and dP − delta is exactly 0, as it is on the CPU, instead of a rounding
// difference that a huge scale turns into an overflowing dQ.

template <typename T>
__global__ void __launch_bounds__(kThreads) delta_kernel(const __grid_constant__ AttentionParams p,
                                                         int64_t total_rows) {
  using A = typename AccOf<T>::type;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; row < total_rows;
       row += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t b = row / p.n, i = row % p.n;
    int64_t idx[kMaxBatchDims];
    unravel_batch(p, b, idx);
    const T* out = static_cast<const T*>(p.out.data) + batch_offset(p, p.out, idx) + i * p.out.row_stride;
    const T* dout = static_cast<const T*>(p.grad_out.data) + batch_offset(p, p.grad_out, idx) +
                    i * p.grad_out.row_stride;
    A sum = A(0);
    for (int64_t c = 0; c < p.dv; ++c)
      sum += to_acc(dout[c * p.grad_out.col_stride]) * to_acc(out[c * p.out.col_stride]);
    if (p.grad_lse.data != nullptr)
      sum -= static_cast<const A*>(p.grad_lse.data)[batch_offset(p, p.grad_lse, idx) + i * p.grad_lse.row_stride];
    static_cast<A*>(p.delta.data)[batch_offset(p, p.delta, idx) + i * p.delta.row_stride] = sum;
  }
}

// For the query tile at i0 (rows valid) and key tile at j0 (cols valid) of batch position idx
// (linear b): P∘Z and dS = P ∘ (dP∘Z − delta) in the score layout. Rows/keys outside the tile
// give 0. Xs/Ys: the two staging tiles of tile_dot.
template <typename T>
__device__ __forceinline__ void score_gradient(const AttentionParams& p, const DevCtx<T>& ctx,
                                               const int64_t* idx, int64_t b, int64_t i0, int64_t rows,
                                               int64_t j0, int64_t cols,
                                               typename AccOf<T>::type* Xs, typename AccOf<T>::type* Ys,
                                               int r, int g, typename AccOf<T>::type (&pz)[8],
                                               typename AccOf<T>::type (&ds)[8]) {
  using A = typename AccOf<T>::type;
  const A ninf = neg_inf<A>();
  const int64_t i = i0 + r;
  const T* q = static_cast<const T*>(p.q.data) + batch_offset(p, p.q, idx) + i0 * p.q.row_stride;
  const T* k = static_cast<const T*>(p.k.data) + batch_offset(p, p.k, idx) + j0 * p.k.row_stride;
  const T* v = static_cast<const T*>(p.v.data) + batch_offset(p, p.v, idx) + j0 * p.v.row_stride;
  const T* dout = static_cast<const T*>(p.grad_out.data) + batch_offset(p, p.grad_out, idx) +
                  i0 * p.grad_out.row_stride;
  const int64_t mask_base = p.mask_kind == MaskKind::kNone ? 0 : batch_offset(p, p.mask, idx);
  A hi = ninf, lo = A(0), delta = A(0);
  if (r < rows) {
    hi = static_cast<const A*>(p.shift_hi.data)[batch_offset(p, p.shift_hi, idx) + i * p.shift_hi.row_stride];
    lo = static_cast<const A*>(p.shift_lo.data)[batch_offset(p, p.shift_lo, idx) + i * p.shift_lo.row_stride];
    delta = static_cast<const A*>(p.delta.data)[batch_offset(p, p.delta, idx) + i * p.delta.row_stride];
  }
  tile_logits(pz, p, ctx, Xs, Ys, q, i0, rows, k, j0, cols, mask_base, r, g);
  tile_dot(ds, Xs, Ys, dout, p.grad_out.row_stride, p.grad_out.col_stride, rows, v, p.v.row_stride,
           p.v.col_stride, cols, p.dv, r, g);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    PhiloxWords w{{0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu}};
    if (ctx.dropout) w = ctx.words(b, i, j0 + 32 * h + 4 * g);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int c = 32 * h + 4 * g + e;
      const bool valid = r < rows && c < cols;
      const A pw = (hi == ninf || !valid) ? A(0) : exp2_acc((pz[h * 4 + e] - hi) - lo);
      const bool keep = !ctx.dropout || w.w[e] >= p.dropout_threshold;
      const A dp = keep ? (ctx.dropout ? ds[h * 4 + e] * ctx.inv_keep : ds[h * 4 + e]) : A(0);
      ds[h * 4 + e] = valid ? pw * (dp - delta) : A(0);
      pz[h * 4 + e] = keep ? (ctx.dropout ? pw * ctx.inv_keep : pw) : A(0);
    }
  }
}

template <typename A>
constexpr size_t bwd_kv_smem() {
  constexpr int OC = BwdCfg<A>::kOC;
  return sizeof(A) * (kBM * kLdC + kBN * kLdC + 2 * kBM * kLdS + 2 * kBM * OC);
}

// dK, dV for (K owner, key tile, column chunk); columns [c0, c0 + OC) of both dK and dV.
// Accumulator layout: key row kr = t / 4, columns (t % 4) + 4·jj.
template <typename T>
__global__ void __launch_bounds__(kThreads) bwd_kv_kernel(const __grid_constant__ AttentionParams p,
                                                          int64_t total) {
  using A = typename AccOf<T>::type;
  constexpr int OC = BwdCfg<A>::kOC;
  constexpr int NACC = OC / 4;
  ATTN_DYNAMIC_SHARED(smem_raw);
  A* Xs = reinterpret_cast<A*>(smem_raw);
  A* Ys = Xs + kBM * kLdC;
  A* Ps = Ys + kBN * kLdC;
  A* dSs = Ps + kBM * kLdS;
  A* dOo = dSs + kBM * kLdS;
  A* Qo = dOo + kBM * OC;
  const int tid = threadIdx.x, r = tid >> 3, g = tid & 7;
  const int kr = tid >> 2, kc = tid & 3;
  const DevCtx<T> ctx(p);
  const BatchSplit split(p, p.grad_k);
  const int64_t n_kt = ceil_div(p.m, kBN);
  const int64_t n_oc = imax(1, ceil_div(imax(p.dk, p.dv), OC));

  for (int64_t item = blockIdx.x; item < total; item += gridDim.x) {
    const int64_t oc = item % n_oc;
    const int64_t kt = (item / n_oc) % n_kt;
    const int64_t owner = item / (n_oc * n_kt);
    const int64_t j0 = kt * kBN, cols = imin(kBN, p.m - j0);
    const int64_t c0 = oc * OC;
    const int64_t dk_cols = imax(0, imin(OC, p.dk - c0)), dv_cols = imax(0, imin(OC, p.dv - c0));
    A acc_k[NACC], acc_v[NACC];
#pragma unroll
    for (int t = 0; t < NACC; ++t) acc_k[t] = acc_v[t] = A(0);
    int64_t idx[kMaxBatchDims];
    const int64_t row_begin = first_row_seeing(p, j0) / kBM * kBM;
    for (int64_t bc = 0; bc < split.num_bcast; ++bc) {
      split.index(p, owner, bc, idx);
      const int64_t b = ravel_batch(p, idx);
      const T* q = static_cast<const T*>(p.q.data) + batch_offset(p, p.q, idx) + c0 * p.q.col_stride;
      const T* dout = static_cast<const T*>(p.grad_out.data) + batch_offset(p, p.grad_out, idx) +
                      c0 * p.grad_out.col_stride;
      for (int64_t i0 = row_begin; i0 < p.n; i0 += kBM) {
        const int64_t rows = imin(kBM, p.n - i0);
        A pz[8], ds[8];
        score_gradient<T>(p, ctx, idx, b, i0, rows, j0, cols, Xs, Ys, r, g, pz, ds);
        // (score_gradient ends with a tile_dot whose last barrier precedes its compute; the
        // barrier below orders that compute before Ps / dSs / dOo / Qo are overwritten.)
        __syncthreads();
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            Ps[r * kLdS + 32 * h + 4 * g + e] = pz[h * 4 + e];
            dSs[r * kLdS + 32 * h + 4 * g + e] = ds[h * 4 + e];
          }
        load_tile<kBM, OC>(dOo, OC, dout + i0 * p.grad_out.row_stride, p.grad_out.row_stride,
                           p.grad_out.col_stride, rows, dv_cols);
        load_tile<kBM, OC>(Qo, OC, q + i0 * p.q.row_stride, p.q.row_stride, p.q.col_stride, rows, dk_cols);
        __syncthreads();
#pragma unroll 2
        for (int ii = 0; ii < kBM; ++ii) {
          const A pv = Ps[ii * kLdS + kr];
          const A dsv = dSs[ii * kLdS + kr];
#pragma unroll
          for (int t = 0; t < NACC; ++t) {
            acc_v[t] += pv * dOo[ii * OC + kc + 4 * t];
            acc_k[t] += dsv * Qo[ii * OC + kc + 4 * t];
          }
        }
      }
    }
    if (kr < cols) {
      split.index(p, owner, 0, idx);
      T* gk = static_cast<T*>(p.grad_k.data) + batch_offset(p, p.grad_k, idx) + (j0 + kr) * p.grad_k.row_stride;
      T* gv = static_cast<T*>(p.grad_v.data) + batch_offset(p, p.grad_v, idx) + (j0 + kr) * p.grad_v.row_stride;
      const A scale = static_cast<A>(p.scale);
#pragma unroll
      for (int t = 0; t < NACC; ++t) {
        const int c = kc + 4 * t;
        if (c < dk_cols) store_acc(static_cast<A>(acc_k[t] * scale), gk + (c0 + c) * p.grad_k.col_stride);
        if (c < dv_cols) store_acc(acc_v[t], gv + (c0 + c) * p.grad_v.col_stride);
      }
    }
  }
}

template <typename A>
constexpr size_t bwd_q_smem() {
  constexpr int OC = BwdCfg<A>::kOC;
  return sizeof(A) * (kBM * kLdC + kBN * kLdC + kBM * kLdS + kBN * OC);
}

// dQ for (Q owner, query tile, column chunk). Accumulator layout: row r = t / 8, columns
// g + 8·jj.
template <typename T>
__global__ void __launch_bounds__(kThreads) bwd_q_kernel(const __grid_constant__ AttentionParams p,
                                                         int64_t total) {
  using A = typename AccOf<T>::type;
  constexpr int OC = BwdCfg<A>::kOC;
  constexpr int NACC = OC / 8;
  ATTN_DYNAMIC_SHARED(smem_raw);
  A* Xs = reinterpret_cast<A*>(smem_raw);
  A* Ys = Xs + kBM * kLdC;
  A* dSs = Ys + kBN * kLdC;
  A* Ko = dSs + kBM * kLdS;
  const int tid = threadIdx.x, r = tid >> 3, g = tid & 7;
  const DevCtx<T> ctx(p);
  const BatchSplit split(p, p.grad_q);
  const int64_t n_qt = ceil_div(p.n, kBM);
  const int64_t n_oc = imax(1, ceil_div(p.dk, OC));

  for (int64_t item = blockIdx.x; item < total; item += gridDim.x) {
    const int64_t oc = item % n_oc;
    const int64_t qt = (item / n_oc) % n_qt;
    const int64_t owner = item / (n_oc * n_qt);
    const int64_t i0 = qt * kBM, rows = imin(kBM, p.n - i0);
    const int64_t c0 = oc * OC, dk_cols = imax(0, imin(OC, p.dk - c0));
    A acc[NACC];
#pragma unroll
    for (int t = 0; t < NACC; ++t) acc[t] = A(0);
    int64_t idx[kMaxBatchDims];
    const int64_t key_end = visible_key_end(p, i0, rows);
    for (int64_t bc = 0; bc < split.num_bcast; ++bc) {
      split.index(p, owner, bc, idx);
      const int64_t b = ravel_batch(p, idx);
      const T* k = static_cast<const T*>(p.k.data) + batch_offset(p, p.k, idx) + c0 * p.k.col_stride;
      for (int64_t j0 = 0; j0 < key_end; j0 += kBN) {
        const int64_t cols = imin(kBN, p.m - j0);
        A pz[8], ds[8];
        score_gradient<T>(p, ctx, idx, b, i0, rows, j0, cols, Xs, Ys, r, g, pz, ds);
        __syncthreads();
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int e = 0; e < 4; ++e) dSs[r * kLdS + 32 * h + 4 * g + e] = ds[h * 4 + e];
        load_tile<kBN, OC>(Ko, OC, k + j0 * p.k.row_stride, p.k.row_stride, p.k.col_stride, cols, dk_cols);
        __syncthreads();
        const A* dsrow = dSs + r * kLdS;
#pragma unroll 4
        for (int jj = 0; jj < kBN; ++jj) {
          const A dsv = dsrow[jj];
#pragma unroll
          for (int t = 0; t < NACC; ++t) acc[t] += dsv * Ko[jj * OC + g + 8 * t];
        }
      }
    }
    if (r < rows) {
      split.index(p, owner, 0, idx);
      T* gq = static_cast<T*>(p.grad_q.data) + batch_offset(p, p.grad_q, idx) + (i0 + r) * p.grad_q.row_stride;
      const A scale = static_cast<A>(p.scale);
#pragma unroll
      for (int t = 0; t < NACC; ++t) {
        const int c = g + 8 * t;
        if (c < dk_cols) store_acc(static_cast<A>(acc[t] * scale), gq + (c0 + c) * p.grad_q.col_stride);
      }
    }
  }
}

template <typename A>
constexpr size_t bwd_mask_smem() {
  return sizeof(A) * (kBM * kLdC + kBN * kLdC + kBM * kLdS);
}

// Gradient of a floating mask: item = (mask owner, mask row tile, mask key tile). When the mask
// broadcasts over query rows (row_stride 0 with n > 1) the row tile is all rows; when it
// broadcasts over keys the key tile is all keys. grad_mask is zero-filled by the caller.
template <typename T>
__global__ void __launch_bounds__(kThreads) bwd_mask_kernel(const __grid_constant__ AttentionParams p,
                                                            int64_t total) {
  using A = typename AccOf<T>::type;
  ATTN_DYNAMIC_SHARED(smem_raw);
  A* Xs = reinterpret_cast<A*>(smem_raw);
  A* Ys = Xs + kBM * kLdC;
  A* Gs = Ys + kBN * kLdC;
  const int tid = threadIdx.x, r = tid >> 3, g = tid & 7;
  const DevCtx<T> ctx(p);
  const BatchSplit split(p, p.grad_mask);
  const bool rows_bcast = p.n > 1 && p.grad_mask.row_stride == 0;
  const bool cols_bcast = p.m > 1 && p.grad_mask.col_stride == 0;
  const int64_t n_qt = ceil_div(p.n, kBM), n_kt = ceil_div(p.m, kBN);
  const int64_t n_row_items = rows_bcast ? 1 : n_qt;
  const int64_t n_col_items = cols_bcast ? 1 : n_kt;

  for (int64_t item = blockIdx.x; item < total; item += gridDim.x) {
    const int64_t ct = item % n_col_items;
    const int64_t rt = (item / n_col_items) % n_row_items;
    const int64_t owner = item / (n_col_items * n_row_items);
    const int64_t q_begin = rows_bcast ? 0 : rt * kBM;
    const int64_t q_end = rows_bcast ? p.n : imin(p.n, q_begin + kBM);
    const int64_t kt_begin = cols_bcast ? 0 : ct, kt_end = cols_bcast ? n_kt : ct + 1;
    const int64_t key_end = visible_key_end(p, q_begin, q_end - q_begin);
    int64_t idx[kMaxBatchDims];
    split.index(p, owner, 0, idx);
    T* gm = static_cast<T*>(p.grad_mask.data) + batch_offset(p, p.grad_mask, idx);
    A row_acc = A(0);  // cols_bcast: thread t < kBM sums mask row t (t = 0 when rows_bcast too)
    for (int64_t kt = kt_begin; kt < kt_end; ++kt) {
      const int64_t j0 = kt * kBN;
      if (j0 >= key_end) break;  // invisible keys: gradient stays 0 (uniform over the CTA)
      const int64_t cols = imin(kBN, p.m - j0);
      A gacc[8];
#pragma unroll
      for (int t = 0; t < 8; ++t) gacc[t] = A(0);
      const int64_t i_first = rows_bcast ? imax(q_begin, first_row_seeing(p, j0) / kBM * kBM) : q_begin;
      for (int64_t bc = 0; bc < split.num_bcast; ++bc) {
        split.index(p, owner, bc, idx);
        const int64_t b = ravel_batch(p, idx);
        for (int64_t i0 = i_first; i0 < q_end; i0 += kBM) {
          const int64_t rows = imin(kBM, q_end - i0);
          A pz[8], ds[8];
          score_gradient<T>(p, ctx, idx, b, i0, rows, j0, cols, Xs, Ys, r, g, pz, ds);
#pragma unroll
          for (int t = 0; t < 8; ++t) gacc[t] += ds[t];
        }
      }
      __syncthreads();
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int e = 0; e < 4; ++e) Gs[r * kLdS + 32 * h + 4 * g + e] = gacc[h * 4 + e];
      __syncthreads();
      if (!rows_bcast && !cols_bcast) {
        const int64_t i = q_begin + r;
        if (i < q_end) {
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int c = 32 * h + 4 * g + e;
              if (c < cols)
                store_acc(gacc[h * 4 + e], gm + i * p.grad_mask.row_stride + (j0 + c) * p.grad_mask.col_stride);
            }
        }
      } else if (rows_bcast && !cols_bcast) {
        if (tid < cols) {
          A sum = A(0);
          for (int rr = 0; rr < kBM; ++rr) sum += Gs[rr * kLdS + tid];
          store_acc(sum, gm + (j0 + tid) * p.grad_mask.col_stride);
        }
      } else if (!rows_bcast) {  // cols_bcast only
        if (tid < kBM) {
          A sum = A(0);
          for (int cc = 0; cc < kBN; ++cc) sum += Gs[tid * kLdS + cc];
          row_acc += sum;
        }
      } else {  // both broadcast: one scalar per owner
        if (tid == 0) {
          A sum = A(0);
          for (int rr = 0; rr < kBM; ++rr)
            for (int cc = 0; cc < kBN; ++cc) sum += Gs[rr * kLdS + cc];
          row_acc += sum;
        }
      }
    }
    if (cols_bcast) {
      if (rows_bcast) {
        if (tid == 0) store_acc(row_acc, gm);
      } else if (tid < kBM && q_begin + tid < q_end) {
        store_acc(row_acc, gm + (q_begin + tid) * p.grad_mask.row_stride);
      }
    }
  }
}

// The backward passes, in the order launch_backward runs them. Each returns the launch status.
// The tensor-core backward (tc_backward.cuh) replaces the kv and q passes and keeps the others.
template <typename T>
cudaError_t launch_backward_prologue(const AttentionParams& p, cudaStream_t stream) {  // shift, delta
  const int64_t rows = p.batch_numel * p.n;
  cudaError_t err = launch_row_shift<T>(p, stream);
  if (err != cudaSuccess) return err;
  ATTN_LAUNCH(delta_kernel<T>, grid_for(ceil_div(rows, kThreads)), kThreads, 0, stream)(p, rows);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_backward_kv(const AttentionParams& p, cudaStream_t stream) {
  using A = typename AccOf<T>::type;
  constexpr int OC = BwdCfg<A>::kOC;
  const int64_t total = owners_of(p, p.grad_k) * ceil_div(p.m, kBN) * imax(1, ceil_div(imax(p.dk, p.dv), OC));
  if (total <= 0) return cudaSuccess;
  constexpr size_t smem = bwd_kv_smem<A>();
  cudaError_t err = prepare_smem(bwd_kv_kernel<T>, smem);
  if (err != cudaSuccess) return err;
  ATTN_LAUNCH(bwd_kv_kernel<T>, grid_for(total), kThreads, smem, stream)(p, total);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_backward_q(const AttentionParams& p, cudaStream_t stream) {
  using A = typename AccOf<T>::type;
  constexpr int OC = BwdCfg<A>::kOC;
  const int64_t total = owners_of(p, p.grad_q) * ceil_div(p.n, kBM) * imax(1, ceil_div(p.dk, OC));
  if (total <= 0) return cudaSuccess;
  constexpr size_t smem = bwd_q_smem<A>();
  cudaError_t err = prepare_smem(bwd_q_kernel<T>, smem);
  if (err != cudaSuccess) return err;
  ATTN_LAUNCH(bwd_q_kernel<T>, grid_for(total), kThreads, smem, stream)(p, total);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_backward_mask(const AttentionParams& p, cudaStream_t stream) {
  using A = typename AccOf<T>::type;
  if (p.grad_mask.data == nullptr) return cudaSuccess;
  const bool rows_bcast = p.n > 1 && p.grad_mask.row_stride == 0;
  const bool cols_bcast = p.m > 1 && p.grad_mask.col_stride == 0;
  const int64_t total = owners_of(p, p.grad_mask) * (rows_bcast ? 1 : ceil_div(p.n, kBM)) *
                        (cols_bcast ? 1 : ceil_div(p.m, kBN));
  if (total <= 0) return cudaSuccess;
  constexpr size_t smem = bwd_mask_smem<A>();
  cudaError_t err = prepare_smem(bwd_mask_kernel<T>, smem);
  if (err != cudaSuccess) return err;
  ATTN_LAUNCH(bwd_mask_kernel<T>, grid_for(total), kThreads, smem, stream)(p, total);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_backward(const AttentionParams& p, const BackwardPlan& plan, cudaStream_t stream) {
  if (p.batch_numel * p.n <= 0) return cudaSuccess;
  cudaError_t err = launch_backward_prologue<T>(p, stream);
  if (err == cudaSuccess && plan.kv) err = launch_backward_kv<T>(p, stream);
  if (err == cudaSuccess && plan.q) err = launch_backward_q<T>(p, stream);
  if (err == cudaSuccess && plan.mask) err = launch_backward_mask<T>(p, stream);
  return err;
}

}  // namespace simt
}  // namespace cuda
}  // namespace attention_ext
