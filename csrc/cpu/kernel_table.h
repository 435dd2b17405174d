// The CPU kernels of one instruction-set variant, as a table of plain functions.
//
// Each variant (avx512bf16, avx512, avx2, generic) is the same source compiled with its own target
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
// the work (and with it the bitwise result) depends only on the shape and the variant.
constexpr int64_t kBlockM = 64;
constexpr int64_t kBlockN = 64;
// Calls with at most this many query rows take the decode forward (forward_decode below).
constexpr int64_t kDecodeRows = 8;
// The decode forward runs the query heads that share one K/V head (GQA: the innermost batch dim,
// over which k and v are broadcast with stride 0) as the rows of one item, so that each K/V row
// is read from memory once for all of them, not once per head: up to this many rows (heads × n).
constexpr int64_t kDecodeGroupRows = 32;

// Query heads per decode item: the largest divisor of the shared-K/V dim's size whose heads fit
// kDecodeGroupRows rows (1 without such a dim). A function of the shape alone.
inline int64_t decode_heads_per_item(const AttentionParams& p) {
  if (p.batch_ndim == 0 || p.n == 0) return 1;
  const int dim = p.batch_ndim - 1;
  const int64_t size = p.batch_size[dim];
  if (size <= 1 || p.k.batch_stride[dim] != 0 || p.v.batch_stride[dim] != 0) return 1;
  for (int64_t heads = size; heads > 1; --heads)
    if (size % heads == 0 && heads * p.n <= kDecodeGroupRows) return heads;
  return 1;
}

// Each function processes work items [begin, end); items are independent and write disjoint
// outputs, so any partition across threads gives bitwise identical results.
using ItemFn = void (*)(const AttentionParams&, int64_t begin, int64_t end);

struct KernelTable {
  const char* name;
  // items: batch_numel * ceil(n / kBlockM). Writes out, lse.
  ItemFn forward;
  // Decode forward, n <= kDecodeRows: items = batch_numel / decode_heads_per_item * kv_splits,
  // each all n rows of those heads against one range of split_keys keys, reading K and V rows in place (no transposed packing). Writes
  // out and lse when kv_splits == 1, else split_out / split_stats for forward_combine.
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
  // items: batch_numel * ceil(n / kBlockM). Writes probs from lse.
  ItemFn probabilities;
  // Runs `iterations` rounds of independent vector FMAs on the calling thread; returns the flops
  // done (fma_probe.inc). For measuring the machine's FMA peak, not for attention.
  double (*fma_probe)(int64_t iterations);
};

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
namespace avx512bf16 {
void fill_forward_kernels(KernelTable&);  // its backward is avx512's
}
#endif
#undef ATTN_DECLARE_VARIANT_STAGES

}  // namespace cpu
}  // namespace attention_ext
