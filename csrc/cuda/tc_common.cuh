// Building blocks shared by the tensor-core kernels (tc_forward.cuh, tc_backward.cuh): the CTA
// shape, swizzled shared tiles filled by cp.async, the ldmatrix fragment loads of those tiles, and
// which calls the kernels can take.
//
// Shared tiles hold rows of D 16-bit elements, XOR-swizzled in 16-byte chunks (chunk c of row r
// lives at c ^ (r % 8)), so the eight rows one ldmatrix phase reads hit eight different bank
// groups without padding. Fragment layouts: warp_mma.cuh.
#pragma once
#include <cstdlib>

#include "common.cuh"
#include "warp_mma.cuh"

namespace attention_ext {
namespace cuda {
namespace tc {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kTile = 16 * kWarps;  // rows of a tile: 64 queries or 64 keys, 16 per warp

// Element offset of (row r, column c) in a swizzled tile of rows of D elements.
template <int D>
__device__ __forceinline__ int swizzled(int r, int c) {
  return r * D + ((((c >> 3) ^ (r & 7))) << 3) + (c & 7);
}

// Copies rows [0, ROWS) of a (rows, D) tile whose row r starts at g + r * row_stride into a
// swizzled shared tile; rows >= valid are zero-filled (so they contribute no NaN from stale data).
template <typename T, int D, int ROWS = kTile>
__device__ __forceinline__ void load_tile_async(T* tile, const T* g, int64_t row_stride, int64_t valid, int tid) {
  constexpr int kChunks = D / 8;
  for (int e = tid; e < ROWS * kChunks; e += kThreads) {
    const int r = e / kChunks, c = (e % kChunks) * 8;
    const bool in_range = r < valid;
    cp_async_16(tile + swizzled<D>(r, c), in_range ? g + r * row_stride + c : g, in_range);
  }
}

// The A fragment (rows r0..r0+15, columns c0..c0+15) of a tile.
template <int D, typename T>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const T* tile, int r0, int c0, int lane) {
  ldmatrix_x4(a, tile + swizzled<D>(r0 + ((lane >> 3) & 1) * 8 + (lane & 7), c0 + (lane >> 4) * 8));
}
// B fragments of two n-tiles when tile rows are the n index (rows n0..n0+15) and columns the k
// index (c0..c0+15), as K in Q Kᵀ: b[0], b[1] for n0..n0+7, b[2], b[3] for n0+8..n0+15.
template <int D, typename T>
__device__ __forceinline__ void load_b_nk(uint32_t (&b)[4], const T* tile, int n0, int c0, int lane) {
  ldmatrix_x4(b, tile + swizzled<D>(n0 + (lane >> 4) * 8 + (lane & 7), c0 + ((lane >> 3) & 1) * 8));
}
// B fragments of two n-tiles when tile rows are the k index (rows k0..k0+15) and columns the n
// index (n0..n0+15), as V in P V: b[0], b[1] for n0..n0+7, b[2], b[3] for n0+8..n0+15.
template <int D, typename T>
__device__ __forceinline__ void load_b_kn(uint32_t (&b)[4], const T* tile, int k0, int n0, int lane) {
  ldmatrix_x4_trans(b, tile + swizzled<D>(k0 + ((lane >> 3) & 1) * 8 + (lane & 7), n0 + (lane >> 4) * 8));
}

// The A fragment of k-step kk from C accumulators c[nt] (n-tiles 2kk, 2kk + 1), rounded to T:
// the C layout of two n-tiles is the A layout of one k-step, so P / dS never leave registers.
template <typename T>
__device__ __forceinline__ void a_from_c(uint32_t (&a)[4], const float (&c0)[4], const float (&c1)[4]) {
  a[0] = MmaType<T>::pack(c0[0], c0[1]);
  a[1] = MmaType<T>::pack(c0[2], c0[3]);
  a[2] = MmaType<T>::pack(c1[0], c1[1]);
  a[3] = MmaType<T>::pack(c1[2], c1[3]);
}

// acc (16 x D, C layout) += a (16 x 16) · rows k0..k0+15 of a tile whose rows are the k index and
// whose D columns the n index (P·V, dSᵀ·Q, dS·K): D/16 ldmatrix.x4.trans, D/8 mma's.
template <typename T, int D>
__device__ __forceinline__ void mma_a_tile(float (&acc)[D / 8][4], const uint32_t (&a)[4], const T* tile, int k0,
                                           int lane) {
#pragma unroll
  for (int dn = 0; dn < D / 16; ++dn) {
    uint32_t b[4];
    load_b_kn<D>(b, tile, k0, dn * 16, lane);
    mma_m16n8k16<T>(acc[2 * dn], a, b[0], b[1]);
    mma_m16n8k16<T>(acc[2 * dn + 1], a, b[2], b[3]);
  }
}

// Writes this thread's part of row g + 8h of a 16 x D accumulator (C layout), times scale, to
// the output row at dst: columns 2t, 2t + 1 of every 8.
template <int D, typename T>
__device__ __forceinline__ void store_acc_row(const float (&acc)[D / 8][4], int h, int t4, float scale, T* dst,
                                              int64_t col_stride) {
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) {
    const int c = nt * 8 + 2 * t4;
    store_acc2(acc[nt][2 * h] * scale, acc[nt][2 * h + 1] * scale, dst + c * col_stride, col_stride);
  }
}

// Whether every (row, key) of the BM-row query tile at i0 (rows in range) and the BN-key tile at
// j0 (cols in range) is in range, unmasked, unmodified and visible: then a logit is just the
// scaled score.
template <int BM, int BN>
__device__ __forceinline__ bool interior_tile(const AttentionParams& p, int64_t i0, int64_t rows, int64_t j0,
                                              int64_t cols) {
  return p.mask_kind == MaskKind::kNone && p.softcap == 0.0 && p.alibi_slopes.data == nullptr && rows == BM &&
         cols == BN &&
         (!has_band(p) || tile_inside_band(p, i0, BM, j0, BN));
}

// Rows of t are 16-byte aligned runs of contiguous elements (what cp.async copies).
inline bool rows_are_aligned_chunks(const AttentionParams& p, const TensorRef& t) {
  if (t.col_stride != 1 || t.row_stride % 8 != 0 || reinterpret_cast<uintptr_t>(t.data) % 16 != 0) return false;
  for (int d = 0; d < p.batch_ndim; ++d)
    if (t.batch_stride[d] % 8 != 0) return false;
  return true;
}

// Whether the device runs this build's device code from PTX for sm_80 or later (dispatch.cu: one
// definition, asked once per device).
bool device_runs_sm80_code(int device);

// Calls the tensor-core kernels take: fp16/bf16, d_k == d_v == 64 or 128, Q/K/V rows of aligned
// chunks, ATTENTION_EXT_CUDA_SIMT not set to 1 (which forces the SIMT kernels, for testing and
// comparison), and
//  * fp16 dropout keeping P·1/(1 − p) finite: the kernels round the scaled P to fp16 for the
//    P·V product, so 1/(1 − p) must stay within fp16's largest finite 65504 (the SIMT kernels keep
//    P in float);
//  * a device of compute capability >= 8.0 running code from PTX for sm_80 or later: a build
//    for an older architecture (TORCH_CUDA_ARCH_LIST="7.5+PTX", JIT-compiled on an sm_90 GPU)
//    has the tensor-core instructions compiled to a trap (warp_mma.cuh).
inline bool eligible(const AttentionParams& p) {
  if (!((p.dtype == ScalarType::kFloat16 || p.dtype == ScalarType::kBFloat16) && p.dk == p.dv &&
        (p.dk == 64 || p.dk == 128)))
    return false;
  if (!rows_are_aligned_chunks(p, p.q) || !rows_are_aligned_chunks(p, p.k) || !rows_are_aligned_chunks(p, p.v))
    return false;
  if (p.dtype == ScalarType::kFloat16 && p.dropout_p > 0.0 && 1.0 / (1.0 - p.dropout_p) > 65504.0) return false;
  const char* force_simt = std::getenv("ATTENTION_EXT_CUDA_SIMT");
  if (force_simt != nullptr && force_simt[0] == '1') return false;
  int device = 0, major = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess || major < 8)
    return false;
  return device_runs_sm80_code(device);
}

}  // namespace tc
}  // namespace cuda
}  // namespace attention_ext
