// The CPU kernels of one instruction-set variant, as a table of plain functions.
//
// Each variant (amx, avx512bf16, avx512, avx2, generic) is the same source compiled with its own target
// flags and namespace, one translation unit per stage (isa_begin.h; variants/<isa>_<stage>.cpp).
// The torch-facing binding picks a table at run time from what the CPU supports, so code built
// for a wider ISA never runs on a CPU without it. No torch headers here: the kernel TUs must not
// instantiate torch code.
#pragma once
#include <stdint.h>

#include "../attention_params.h"

namespace attention_ext {
namespace cpu {

// Query rows per work item and keys per inner tile. Fixed across variants, so the partition of
// the work (and with it the bitwise result) depends only on the shape, the variant and (the
// decode's key ranges) the K/V layout: never on the thread count.
constexpr int64_t kBlockM = 64;
constexpr int64_t kBlockN = 64;
// Calls with at most this many query rows take the decode forward (forward_decode below).
constexpr int64_t kDecodeRows = 8;
// How the decode forward groups batch indices into one work item; a function of the shape alone.
//   shared: the query heads that share one K/V head (GQA: the innermost batch dim, over which k
//     and v are broadcast with stride 0) run as the rows of one tile, so each K/V row is read from
//     memory once for all of them, not once per head: up to kDecodeGroupRows rows (heads × n).
//   lockstep: K/V heads stored interleaved (a (tokens, heads, d) cache: the next batch dim out has
//     a K and V stride below the row stride) are walked key tile by key tile together, so memory
//     is read in storage order (one head at a time would read a few hundred bytes of each token's
//     row and skip the rest, which defeats the hardware prefetchers and the TLB). Only with whole
//     GQA groups, so that an item's batch indices are consecutive: up to kDecodeItemHeads heads.
constexpr int64_t kDecodeGroupRows = 32;
constexpr int64_t kDecodeItemHeads = 32;
static_assert(kDecodeGroupRows <= kDecodeItemHeads, "an item holds at least one whole GQA group");

struct DecodeGrouping {
  int64_t shared = 1;
  int64_t lockstep = 1;
  int64_t heads() const { return shared * lockstep; }  // consecutive batch indices per item
};

inline int64_t largest_divisor_at_most(int64_t size, int64_t limit) {
  for (int64_t d = limit < size ? limit : size; d > 1; --d)
    if (size % d == 0) return d;
  return 1;
}

inline DecodeGrouping decode_grouping(const AttentionParams& p) {
  DecodeGrouping g;
  if (p.n == 0 || p.n > kDecodeGroupRows) return g;
  // (Dims of size 1, e.g. a group of one query head per K/V head, change no batch index.)
  int dim = p.batch_ndim - 1;
  while (dim >= 0 && p.batch_size[dim] == 1) --dim;
  if (dim >= 0 && p.k.batch_stride[dim] == 0 && p.v.batch_stride[dim] == 0) {
    g.shared = largest_divisor_at_most(p.batch_size[dim], kDecodeGroupRows / p.n);
    if (g.shared != p.batch_size[dim]) return g;
    --dim;
    while (dim >= 0 && p.batch_size[dim] == 1) --dim;
  }
  auto below_rows = [](int64_t stride, int64_t row_stride) {
    return stride != 0 && (stride < 0 ? -stride : stride) < (row_stride < 0 ? -row_stride : row_stride);
  };
  // (A paged cache of one-row blocks: one key to the next is the blocks' stride; the rows' is 0,
  // a size-1 dim's. Its heads then walk together as a contiguous cache's do, in the same key
  // ranges, so the bits are the same.)
  const bool one_row_blocks = p.key_blocks != nullptr && p.block_size == 1;
  const int64_t k_rows = one_row_blocks ? p.k_block_stride : p.k.row_stride;
  const int64_t v_rows = one_row_blocks ? p.v_block_stride : p.v.row_stride;
  if (dim >= 0 && p.batch_size[dim] > 1 && below_rows(p.k.batch_stride[dim], k_rows) &&
      below_rows(p.v.batch_stride[dim], v_rows))
    g.lockstep = largest_divisor_at_most(p.batch_size[dim], kDecodeItemHeads / g.shared);
  return g;
}

// Each function processes work items [begin, end); items are independent and write disjoint
// outputs, so any partition across threads gives bitwise identical results.
using ItemFn = void (*)(const AttentionParams&, int64_t begin, int64_t end);

struct KernelTable {
  const char* name;
  // The variant's vector width in bytes (its ATTN_VEC_BYTES: 64 AVX-512, 32 AVX2, 16 SSE2/NEON).
  // Some summation orders follow it (fp32 decode rows four at a time on 64-byte vectors), so
  // build_info() reports it for tests and users who compare bits across variants.
  int vector_bytes;
  // items: batch_numel * ceil(n / kBlockM). Writes out, lse.
  ItemFn forward;
  // Decode forward, n <= kDecodeRows: items = batch_numel / decode_grouping(p).heads() * kv_splits,
  // each all n rows of those heads against one range of split_keys keys, reading K and V rows in
  // place (no transposed packing). Writes out and lse when kv_splits == 1, else split_out /
  // split_stats for forward_combine.
  ItemFn forward_decode;
  // items: batch_numel. Merges the kv_splits partial results of each row, in range order, into
  // out and lse.
  ItemFn forward_combine;
  // items: batch_numel * ceil(n / kBlockM). Writes shift_hi/shift_lo from lse (recomputing the
  // row max and sum exactly for rows of very large |lse|). Runs before backward and probs.
  ItemFn row_shift;
  // items: batch_numel * ceil(n / kBlockM). Writes delta = rowsum(dO * O) - dlse.
  ItemFn backward_delta;
  // items: (owners of k) * ceil(m / kBlockN). Writes grad_k, grad_v.
  ItemFn backward_kv;
  // items: (owners of q) * ceil(n / kBlockM). Writes grad_q.
  ItemFn backward_q;
  // items: owners of k (each covers all key tiles). Writes grad_q, grad_k, grad_v; needs a query
  // that is not broadcast. Bitwise identical to backward_kv + backward_q.
  ItemFn backward_fused;
  // items: (owners of the mask) * ceil(mask rows / kBlockM). Writes grad_mask.
  ItemFn backward_mask;
  // The decode backward, n <= kDecodeRows, query not broadcast (backward_decode.inc).
  // items: owners of k. Writes delta and shift_hi/shift_lo of every query row the owner serves.
  ItemFn decode_backward_rows;
  // items: (owners of k) * kv_splits. Writes grad_k, grad_v of its key range, and grad_q (one range)
  // or its partial dQ into split_out.
  ItemFn decode_backward;
  // items: batch_numel. Sums the kv_splits partial dQ of each batch index, in range order, into grad_q.
  ItemFn decode_backward_combine;
  // items: batch_numel * ceil(n / kBlockM). Writes probs from lse.
  ItemFn probabilities;
  // Runs `iterations` rounds of independent vector FMAs on the calling thread; returns the flops
  // done (fma_probe.inc). For measuring the machine's FMA peak, not for attention.
  double (*fma_probe)(int64_t iterations);
  // Runs `iterations` rounds of the forward's two 64 x 64 x 64 tile GEMMs on cache-resident tiles;
  // returns the flops done (fma_probe.inc). The ceiling the kernels' GEMM reaches on this machine.
  double (*tile_gemm_probe)(int64_t iterations);
  // The same two GEMMs with the online-softmax step between them, as the fp32 forward runs a tile
  // (fma_probe.inc): the ceiling of the forward's per-tile work on this machine.
  double (*tile_forward_probe)(int64_t iterations);
  // The fused backward's five products and its P/dS pass on one 64 x 64 tile pair, as the fp32
  // backward runs a plain tile (backward_probe.inc): the ceiling of the backward's per-tile work.
  double (*tile_backward_probe)(int64_t iterations);
};

// The amx variant needs GCC's AMX intrinsics (GCC 11; the variants are compiled under
// `#pragma GCC target`) and an OS that hands a process the tile state on request (Linux 5.16's
// arch_prctl); elsewhere it is not compiled (its files compile to nothing).
#if (defined(__x86_64__) || defined(_M_X64)) && defined(__linux__) && !defined(__clang__) && defined(__GNUC__) && \
    __GNUC__ >= 11
#define ATTN_AMX_COMPILED 1
#endif

// Each stage of a variant fills its part of the table (isa_end.h defines these).
#define ATTN_DECLARE_VARIANT_STAGES(isa)   \
  namespace isa {                          \
  void fill_forward_kernels(KernelTable&);  \
  void fill_backward_kernels(KernelTable&); \
  }
ATTN_DECLARE_VARIANT_STAGES(generic)
#if defined(__x86_64__) || defined(_M_X64)
ATTN_DECLARE_VARIANT_STAGES(avx2)
ATTN_DECLARE_VARIANT_STAGES(avx512)
ATTN_DECLARE_VARIANT_STAGES(avx512bf16)
#endif
#if defined(ATTN_AMX_COMPILED)
ATTN_DECLARE_VARIANT_STAGES(amx)
#endif
#undef ATTN_DECLARE_VARIANT_STAGES

// Whether this process holds AMX's tile state (cpu_dispatch.cpp): Linux grants it on request, and
// the request is made here, once, on the first call that would run tile instructions, not when
// the amx variant is chosen or listed: a granted process must give every signal stack room for
// the tiles (sigaltstack refuses smaller ones), which a process that never runs a bf16 kernel on
// tiles should not have to. Where it is refused, the amx variant's bf16 kernels run the avx512
// variant's code. The answer never changes within a process, so every pass of every call takes
// the same side. False where the amx variant is not compiled.
bool amx_tile_state_granted();
// Whether this CPU runs 512-bit vector operations as two 256-bit halves (AMD Zen 4; cpu_dispatch.cpp
// says how it is told): there the fp32 multiply-adds cost twice what they cost on a full-width core
// relative to memory, and kernels that can trade them for bf16 dot products do (decode_bf16_dot.inc).
// Fixed for the process, like the variant; build_info() reports it.
bool avx512_double_pumped();
// "granted", "refused", or "not requested" (none of the amx variant's tile kernels has run yet).
const char* amx_tile_state();

}  // namespace cpu
}  // namespace attention_ext
