// Tensor-core backward for float16 / bfloat16 with d_k == d_v == D in {64, 128}: the dK/dV and dQ
// passes of simt_backward.cuh on mma.sync.m16n8k16 (fp32 accumulate), with the same work ownership and
// summation order, and no atomics, so gradients are bitwise reproducible. The row-shift and delta
// passes run before them and the mask-gradient pass after, as SIMT kernels (simt_backward.cuh), exactly as
// in simt::launch_backward; P is rebuilt from the saved shift as 2^((s − shift_hi) − shift_lo).
//
// dK/dV: item = (K owner, key tile of 64 keys), warp w owning keys 16w..16w+15. K and V are staged
//   once per item; the query tiles that can see the key tile (of every broadcast position: GQA)
//   stream through double-buffered shared memory (Q, dO by cp.async; the rows' shift and delta).
//   Per chunk of QC queries, in the transposed score layout (keys x queries), all in registers:
//     Sᵀ = K Qᵀ, dPᵀ = V dOᵀ               A: K / V rows (ldmatrix), B: Q / dO rows (ldmatrix)
//     (P∘Z)ᵀ, dSᵀ = Pᵀ ∘ (dPᵀ∘Z − delta)   Z: the dropout keep flags / (1 − p)
//     dV += (P∘Z)ᵀ dO, dK += dSᵀ Q          A: the accumulators above, B: dO / Q rows (ldmatrix.trans)
//   and dK · scale, dV are written once per item.
// dQ: item = (Q owner, query tile of 64 rows), warp w owning rows 16w..16w+15. Q and dO are staged
//   per broadcast position, K and V tiles double buffered as in the forward; per chunk of KC keys:
//     S = Q Kᵀ, dP = dO Vᵀ, dS = P ∘ (dP∘Z − delta), dQ += dS K (B: K rows by ldmatrix.trans),
//   and dQ · scale written once.
// P∘Z and dS are rounded to the storage type as A operands of the second products, as in
// FlashAttention (the SIMT kernels keep them in fp32).
// Memory traffic: dK/dV reads K, V once and Q, dO once per visible (query tile, key tile) pair;
// dQ reads Q, dO once and K, V once per visible pair; each gradient is written once.
#pragma once
#include "simt_backward.cuh"
#include "tc_common.cuh"

namespace attention_ext {
namespace cuda {
namespace tc {

// Queries (dK/dV) and keys (dQ) per register chunk: a chunk's score and dP accumulators live
// beside the D-wide gradient accumulators (two of them in dK/dV), so larger D takes smaller
// chunks. ptxas (CUDA 13, sm_80 and sm_90) keeps dQ and the D = 64 dK/dV kernel spill-free; the
// D = 128 dK/dV kernel (128 accumulator floats) spills about 80 bytes.
template <int D>
constexpr int kv_chunk() {
  return D == 64 ? 32 : 16;
}
template <int D>
constexpr int q_chunk() {
  return D == 64 ? 64 : 32;
}

template <int D>
constexpr size_t bwd_kv_smem() {  // K, V, Q[2], dO[2], then [2][shift_hi, shift_lo, delta][kTile]
  return sizeof(uint16_t) * 6 * kTile * D + sizeof(float) * 2 * 3 * kTile;
}
template <int D>
constexpr size_t bwd_q_smem() {  // Q, dO, K[2], V[2]
  return sizeof(uint16_t) * 6 * kTile * D;
}

// The tensor-core backward also needs dO rows of aligned chunks.
inline bool backward_eligible(const AttentionParams& p) {
  return eligible(p) && rows_are_aligned_chunks(p, p.grad_out);
}

// The two products of a chunk, over the D columns: s = A1 B1ᵀ and dp = A2 B2ᵀ for rows r0..r0+15 of
// A1 / A2 and rows n0..n0+N-1 of B1 / B2 (Sᵀ = K Qᵀ with dPᵀ = V dOᵀ, or S = Q Kᵀ with dP = dO Vᵀ).
// UNROLL: how many of the D/16 steps the compiler unrolls.
template <typename T, int D, int N, int UNROLL>
__device__ __forceinline__ void scores_and_dp(float (&s)[N / 8][4], float (&dp)[N / 8][4], const T* A1,
                                              const T* A2, int r0, const T* B1, const T* B2, int n0, int lane) {
#pragma unroll
  for (int nt = 0; nt < N / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[nt][e] = dp[nt][e] = 0.0f;
#pragma unroll(UNROLL)
  for (int ks = 0; ks < D / 16; ++ks) {
    uint32_t a1[4], a2[4];
    load_a<D>(a1, A1, r0, ks * 16, lane);
    load_a<D>(a2, A2, r0, ks * 16, lane);
#pragma unroll
    for (int np = 0; np < N / 16; ++np) {
      uint32_t b1[4], b2[4];
      load_b_nk<D>(b1, B1, n0 + np * 16, ks * 16, lane);
      load_b_nk<D>(b2, B2, n0 + np * 16, ks * 16, lane);
      mma_m16n8k16<T>(s[2 * np], a1, b1[0], b1[1]);
      mma_m16n8k16<T>(s[2 * np + 1], a1, b1[2], b1[3]);
      mma_m16n8k16<T>(dp[2 * np], a2, b2[0], b2[1]);
      mma_m16n8k16<T>(dp[2 * np + 1], a2, b2[2], b2[3]);
    }
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) bwd_kv_kernel(const __grid_constant__ AttentionParams p,
                                                          int64_t total) {
  constexpr int QC = kv_chunk<D>();
  ATTN_DYNAMIC_SHARED(smem_raw);
  T* Ks = reinterpret_cast<T*>(smem_raw);
  T* Vs = Ks + kTile * D;
  T* Qs = Vs + kTile * D;       // two buffers
  T* dOs = Qs + 2 * kTile * D;  // two buffers
  float* rowv = reinterpret_cast<float*>(dOs + 2 * kTile * D);  // two buffers of hi, lo, delta
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t4 = lane & 3;
  const DevCtx<T> ctx(p);
  const BatchSplit split(p, p.grad_k);
  const int64_t n_kt = ceil_div(p.m, kTile);
  const float ninf = -INFINITY;

  for (int64_t item = blockIdx.x; item < total; item += gridDim.x) {
    const int64_t kt = item % n_kt, owner = item / n_kt;
    const int64_t j0 = kt * kTile, cols = imin(kTile, p.m - j0);
    const int kl0 = warp * 16 + g;  // this thread's key rows in the tile: kl0, kl0 + 8
    int64_t idx[kMaxBatchDims];
    split.index(p, owner, 0, idx);
    const T* k = static_cast<const T*>(p.k.data) + batch_offset(p, p.k, idx) + j0 * p.k.row_stride;
    const T* v = static_cast<const T*>(p.v.data) + batch_offset(p, p.v, idx) + j0 * p.v.row_stride;
    const int64_t row_begin = first_row_seeing(p, j0) / kTile * kTile, row_end = rows_seeing_end(p, j0 + cols);
    const int64_t n_qt = row_begin < row_end ? ceil_div(row_end - row_begin, kTile) : 0;

    float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) dk[nt][e] = dv[nt][e] = 0.0f;

    // The previous item's copies have landed and its readers of every buffer are done.
    cp_async_wait<0>();
    __syncthreads();
    load_tile_async<T, D>(Ks, k, p.k.row_stride, cols, tid);
    load_tile_async<T, D>(Vs, v, p.v.row_stride, cols, tid);
    cp_async_commit();

    for (int64_t bc = 0; bc < split.num_bcast; ++bc) {
      split.index(p, owner, bc, idx);
      const int64_t b = ravel_batch(p, idx);
      const T* q = static_cast<const T*>(p.q.data) + batch_offset(p, p.q, idx);
      const T* dout = static_cast<const T*>(p.grad_out.data) + batch_offset(p, p.grad_out, idx);
      const float* hi_g = static_cast<const float*>(p.shift_hi.data) + batch_offset(p, p.shift_hi, idx);
      const float* lo_g = static_cast<const float*>(p.shift_lo.data) + batch_offset(p, p.shift_lo, idx);
      const float* delta_g = static_cast<const float*>(p.delta.data) + batch_offset(p, p.delta, idx);
      const auto at = ctx.terms(p, idx);

      // Query tile s of this position into buffer s % 2 (rows past n: zeros, shift -inf).
      auto stage = [&](int64_t s) {
        const int64_t i0 = row_begin + s * kTile, rows = imin(kTile, p.n - i0);
        const int buf = static_cast<int>(s & 1);
        load_tile_async<T, D>(Qs + buf * kTile * D, q + i0 * p.q.row_stride, p.q.row_stride, rows, tid);
        load_tile_async<T, D>(dOs + buf * kTile * D, dout + i0 * p.grad_out.row_stride, p.grad_out.row_stride,
                              rows, tid);
        float* rv = rowv + buf * 3 * kTile;
        for (int r = tid; r < kTile; r += kThreads) {
          const int64_t i = i0 + r;
          const bool in_range = r < rows;
          rv[r] = in_range ? hi_g[i * p.shift_hi.row_stride] : ninf;
          rv[kTile + r] = in_range ? lo_g[i * p.shift_lo.row_stride] : 0.0f;
          rv[2 * kTile + r] = in_range ? delta_g[i * p.delta.row_stride] : 0.0f;
        }
      };

      // Every thread is done with the buffers of the previous position (and K, V have landed).
      cp_async_wait<0>();
      __syncthreads();
      if (n_qt > 0) stage(0);
      cp_async_commit();

      for (int64_t t = 0; t < n_qt; ++t) {
        const int64_t i0 = row_begin + t * kTile, rows = imin(kTile, p.n - i0);
        const int buf = static_cast<int>(t & 1);
        // Tile t has landed for every thread, and every thread is done with tile t - 1, whose
        // buffers receive tile t + 1 below.
        cp_async_wait<0>();
        __syncthreads();
        if (t + 1 < n_qt) stage(t + 1);
        cp_async_commit();
        const T* Qb = Qs + buf * kTile * D;
        const T* dOb = dOs + buf * kTile * D;
        const float* hib = rowv + buf * 3 * kTile;
        const float* lob = hib + kTile;
        const float* deltab = hib + 2 * kTile;
        const bool interior = interior_tile<kTile, kTile>(p, i0, rows, j0, cols);

#pragma unroll 1
        for (int qc = 0; qc < kTile; qc += QC) {
          // st[nt][e], dpt[nt][e]: key kl0 + 8 (e >> 1), query qc + 8 nt + 2 t4 + (e & 1).
          float st[QC / 8][4], dpt[QC / 8][4];
          // (Full unrolling of the D steps hoists every fragment load and spills at D = 128.)
          scores_and_dp<T, D, QC, 2>(st, dpt, Ks, Vs, warp * 16, Qb, dOb, qc, lane);
          // (P∘Z)ᵀ into st, dSᵀ into dpt.
#pragma unroll
          for (int nt = 0; nt < QC / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int ql = qc + nt * 8 + 2 * t4 + (e & 1), kl = kl0 + 8 * (e >> 1);
              const int64_t i = i0 + ql, j = j0 + kl;
              const bool valid = ql < rows && kl < cols;
              float dcap = 1.0f;  // the softcap's derivative (1 without one)
              const float x = interior ? st[nt][e] * ctx.scale_log2 : ctx.logit(p, st[nt][e], i, j, valid, at, &dcap);
              const float hi = hib[ql];
              const float pw = (hi == ninf || !valid) ? 0.0f : exp2f((x - hi) - lob[ql]);
              bool keep = true;
              if (ctx.dropout)
                keep = philox_word(ctx.words(b, i, j & ~int64_t(3)), static_cast<int>(j & 3)) >= p.dropout_threshold;
              const float dp = keep ? (ctx.dropout ? dpt[nt][e] * ctx.inv_keep : dpt[nt][e]) : 0.0f;
              dpt[nt][e] = valid ? pw * (dp - deltab[ql]) * dcap : 0.0f;
              st[nt][e] = keep ? (ctx.dropout ? pw * ctx.inv_keep : pw) : 0.0f;
            }
          // dV += (P∘Z)ᵀ dO, then dK += dSᵀ Q, over the chunk's queries (two loops: fewer
          // fragments in flight at once).
#pragma unroll
          for (int kk = 0; kk < QC / 16; ++kk) {
            uint32_t pa[4];
            a_from_c<T>(pa, st[2 * kk], st[2 * kk + 1]);
            mma_a_tile<T, D>(dv, pa, dOb, qc + kk * 16, lane);
          }
#pragma unroll
          for (int kk = 0; kk < QC / 16; ++kk) {
            uint32_t da[4];
            a_from_c<T>(da, dpt[2 * kk], dpt[2 * kk + 1]);
            mma_a_tile<T, D>(dk, da, Qb, qc + kk * 16, lane);
          }
        }
      }
    }

    split.index(p, owner, 0, idx);
    T* gk = static_cast<T*>(p.grad_k.data) + batch_offset(p, p.grad_k, idx) + j0 * p.grad_k.row_stride;
    T* gv = static_cast<T*>(p.grad_v.data) + batch_offset(p, p.grad_v, idx) + j0 * p.grad_v.row_stride;
    const float scale = static_cast<float>(p.scale);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int kl = kl0 + 8 * h;
      if (kl >= cols) continue;
      store_acc_row<D>(dk, h, t4, scale, gk + kl * p.grad_k.row_stride, p.grad_k.col_stride);
      store_acc_row<D>(dv, h, t4, 1.0f, gv + kl * p.grad_v.row_stride, p.grad_v.col_stride);
    }
  }
  cp_async_wait<0>();
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) bwd_q_kernel(const __grid_constant__ AttentionParams p,
                                                         int64_t total) {
  constexpr int KC = q_chunk<D>();
  ATTN_DYNAMIC_SHARED(smem_raw);
  T* Qs = reinterpret_cast<T*>(smem_raw);
  T* dOs = Qs + kTile * D;
  T* Ks = dOs + kTile * D;     // two buffers
  T* Vs = Ks + 2 * kTile * D;  // two buffers
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t4 = lane & 3;
  const DevCtx<T> ctx(p);
  const BatchSplit split(p, p.grad_q);
  const int64_t n_qt = ceil_div(p.n, kTile);
  const float ninf = -INFINITY;

  for (int64_t item = blockIdx.x; item < total; item += gridDim.x) {
    const int64_t qt = item % n_qt, owner = item / n_qt;
    const int64_t i0 = qt * kTile, rows = imin(kTile, p.n - i0);
    const int rl0 = warp * 16 + g;  // this thread's rows in the tile: rl0, rl0 + 8
    const int64_t key_begin = visible_key_tile_begin(p, i0, kTile), key_end = visible_key_end(p, i0, rows);
    const int64_t n_kt = key_end > key_begin ? ceil_div(key_end - key_begin, kTile) : 0;
    int64_t idx[kMaxBatchDims];

    float dq[D / 8][4];
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) dq[nt][e] = 0.0f;

    for (int64_t bc = 0; bc < split.num_bcast; ++bc) {
      split.index(p, owner, bc, idx);
      const int64_t b = ravel_batch(p, idx);
      const T* q = static_cast<const T*>(p.q.data) + batch_offset(p, p.q, idx) + i0 * p.q.row_stride;
      const T* dout = static_cast<const T*>(p.grad_out.data) + batch_offset(p, p.grad_out, idx) +
                      i0 * p.grad_out.row_stride;
      const T* k = static_cast<const T*>(p.k.data) + batch_offset(p, p.k, idx);
      const T* v = static_cast<const T*>(p.v.data) + batch_offset(p, p.v, idx);
      const auto at = ctx.terms(p, idx);
      float hi[2], lo[2], delta[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t i = i0 + rl0 + 8 * h;
        const bool in_range = i < p.n;
        hi[h] = in_range ? static_cast<const float*>(p.shift_hi.data)[batch_offset(p, p.shift_hi, idx) +
                                                                       i * p.shift_hi.row_stride]
                         : ninf;
        lo[h] = in_range ? static_cast<const float*>(p.shift_lo.data)[batch_offset(p, p.shift_lo, idx) +
                                                                       i * p.shift_lo.row_stride]
                         : 0.0f;
        delta[h] = in_range ? static_cast<const float*>(p.delta.data)[batch_offset(p, p.delta, idx) +
                                                                       i * p.delta.row_stride]
                            : 0.0f;
      }

      // The previous position's (or item's) copies have landed and its readers are done.
      cp_async_wait<0>();
      __syncthreads();
      load_tile_async<T, D>(Qs, q, p.q.row_stride, rows, tid);
      load_tile_async<T, D>(dOs, dout, p.grad_out.row_stride, rows, tid);
      if (n_kt > 0) {
        const int64_t cols = imin(kTile, p.m - key_begin);
        load_tile_async<T, D>(Ks, k + key_begin * p.k.row_stride, p.k.row_stride, cols, tid);
        load_tile_async<T, D>(Vs, v + key_begin * p.v.row_stride, p.v.row_stride, cols, tid);
      }
      cp_async_commit();

      for (int64_t t = 0; t < n_kt; ++t) {
        const int64_t j0 = key_begin + t * kTile, cols = imin(kTile, p.m - j0);
        const int buf = static_cast<int>(t & 1);
        cp_async_wait<0>();
        __syncthreads();
        if (t + 1 < n_kt) {
          const int64_t j1 = j0 + kTile, cols1 = imin(kTile, p.m - j1);
          load_tile_async<T, D>(Ks + (buf ^ 1) * kTile * D, k + j1 * p.k.row_stride, p.k.row_stride, cols1, tid);
          load_tile_async<T, D>(Vs + (buf ^ 1) * kTile * D, v + j1 * p.v.row_stride, p.v.row_stride, cols1, tid);
        }
        cp_async_commit();
        const T* Kb = Ks + buf * kTile * D;
        const T* Vb = Vs + buf * kTile * D;
        const bool interior = interior_tile<kTile, kTile>(p, i0, rows, j0, cols);

#pragma unroll 1
        for (int kc = 0; kc < kTile; kc += KC) {
          // s[nt][e], dp[nt][e]: row rl0 + 8 (e >> 1), key kc + 8 nt + 2 t4 + (e & 1).
          float s[KC / 8][4], dp[KC / 8][4];
          scores_and_dp<T, D, KC, D / 16>(s, dp, Qs, dOs, warp * 16, Kb, Vb, kc, lane);
          // dS into dp. Keys kc + 8 nt + 2 t4, +1 lie in the Philox group of 4 starting at
          // kc + 8 nt + (t4 / 2) * 4, at word offset (t4 % 2) * 2.
#pragma unroll
          for (int nt = 0; nt < KC / 8; ++nt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const int64_t i = i0 + rl0 + 8 * h;
              PhiloxWords w{{0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu}};
              if (ctx.dropout) w = ctx.words(b, i, j0 + kc + nt * 8 + (t4 >> 1) * 4);
#pragma unroll
              for (int c = 0; c < 2; ++c) {
                const int e = 2 * h + c;
                const int kl = kc + nt * 8 + 2 * t4 + c;
                const bool valid = i < p.n && kl < cols;
                float dcap = 1.0f;  // the softcap's derivative (1 without one)
                const float x = interior ? s[nt][e] * ctx.scale_log2
                                         : ctx.logit(p, s[nt][e], i, j0 + kl, valid, at, &dcap);
                const float pw = (hi[h] == ninf || !valid) ? 0.0f : exp2f((x - hi[h]) - lo[h]);
                const bool keep = !ctx.dropout || philox_word(w, (t4 & 1) * 2 + c) >= p.dropout_threshold;
                const float dpz = keep ? (ctx.dropout ? dp[nt][e] * ctx.inv_keep : dp[nt][e]) : 0.0f;
                dp[nt][e] = valid ? pw * (dpz - delta[h]) * dcap : 0.0f;
              }
            }
          // dQ += dS K over the chunk's keys.
#pragma unroll
          for (int kk = 0; kk < KC / 16; ++kk) {
            uint32_t da[4];
            a_from_c<T>(da, dp[2 * kk], dp[2 * kk + 1]);
            mma_a_tile<T, D>(dq, da, Kb, kc + kk * 16, lane);
          }
        }
      }
    }

    split.index(p, owner, 0, idx);
    T* gq = static_cast<T*>(p.grad_q.data) + batch_offset(p, p.grad_q, idx) + i0 * p.grad_q.row_stride;
    const float scale = static_cast<float>(p.scale);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int rl = rl0 + 8 * h;
      if (rl >= rows) continue;
      store_acc_row<D>(dq, h, t4, scale, gq + rl * p.grad_q.row_stride, p.grad_q.col_stride);
    }
  }
  cp_async_wait<0>();
}

template <typename T, int D>
cudaError_t launch_backward_d(const AttentionParams& p, const BackwardPlan& plan, cudaStream_t stream) {
  cudaError_t err;
  if (plan.kv) {
    const int64_t total = owners_of(p, p.grad_k) * ceil_div(p.m, kTile);
    if (total > 0) {
      constexpr size_t smem = bwd_kv_smem<D>();
      if ((err = prepare_smem(bwd_kv_kernel<T, D>, smem)) != cudaSuccess) return err;
      auto* const kernel = bwd_kv_kernel<T, D>;
      ATTN_LAUNCH(kernel, grid_for(total), kThreads, smem, stream)(p, total);
      if ((err = cudaGetLastError()) != cudaSuccess) return err;
    }
  }
  if (plan.q) {
    const int64_t total = owners_of(p, p.grad_q) * ceil_div(p.n, kTile);
    if (total > 0) {
      constexpr size_t smem = bwd_q_smem<D>();
      if ((err = prepare_smem(bwd_q_kernel<T, D>, smem)) != cudaSuccess) return err;
      auto* const kernel = bwd_q_kernel<T, D>;
      ATTN_LAUNCH(kernel, grid_for(total), kThreads, smem, stream)(p, total);
      if ((err = cudaGetLastError()) != cudaSuccess) return err;
    }
  }
  return cudaSuccess;
}

// The whole backward: SIMT row shift and delta, tensor-core dK/dV and dQ, SIMT mask gradient.
template <typename T>
cudaError_t launch_backward(const AttentionParams& p, const BackwardPlan& plan, cudaStream_t stream) {
  if (p.batch_numel * p.n <= 0) return cudaSuccess;
  cudaError_t err = simt::launch_backward_prologue<T>(p, stream);
  if (err == cudaSuccess && (plan.kv || plan.q))
    err = p.dk == 64 ? launch_backward_d<T, 64>(p, plan, stream) : launch_backward_d<T, 128>(p, plan, stream);
  if (err == cudaSuccess && plan.mask) err = simt::launch_backward_mask<T>(p, stream);
  return err;
}

}  // namespace tc
}  // namespace cuda
}  // namespace attention_ext
