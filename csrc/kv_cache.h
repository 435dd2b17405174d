// Attention against a key/value cache, as FlashAttention's flash_attn_with_kvcache computes it
// (the appending of new keys, kv_cache_append below on the CPU, and rotary embeddings happen
// before, called from Python): batch b's query rows
// attend to keys [leftpad_b, seqlens_b) of its cache row — cache_batch_idx[b], or b — or, for a
// paged cache, of the blocks block_table[b] lists, in order. Causal masks, windows and ALiBi align
// query i with key i + (seqlens_b − leftpad_b) − n, per batch entry.
//
// Like packed sequences (packed_sequences.h) the kernels need no notion of it: each batch entry is
// a dense call of its own whose K/V pointers start at its cache row (and first key), or which
// reads its keys through its row of the block table (the CPU decode kernel, n ≤ kDecodeRows).
// A paged call the kernel cannot page (more query rows, or the CUDA kernels) copies the entry's
// blocks into one contiguous scratch first (copy_paged_keys).
//
// The op's layouts put the batch (or block) dim first and the row dim second to last:
// query (B, heads..., n, d), caches (B_cache | num_blocks, heads..., S_max | block_size, d);
// out (B, heads..., n, d_v) viewing memory laid out (B, n, heads..., d_v); lse (B, heads..., n).
#pragma once
#include <ATen/core/Tensor.h>  // not ATen/ATen.h, which declares every operator: 4x the parse time

#include <optional>
#include <vector>

#include "op_arguments.h"

namespace attention_ext {

// Whether a and b lie in overlapping bytes, so that some element of each may be the same memory
// (new rows taken from a cache are copied before they are written into it).
bool may_share_memory(const at::Tensor& a, const at::Tensor& b);
// Whether a and b certainly share elements: the same first element, two dense tensors in
// overlapping bytes (ATen's full and partial overlap), or views with the same strides that meet
// (an element of one is an element of the other; interleaved views such as a packed cache's K and
// V halves are not). Caches that are one memory cannot both take appends. (attention_ext/
// kv_cache.py's _same_memory is the Python twin.)
bool same_memory(const at::Tensor& a, const at::Tensor& b);

struct KVCacheCall {
  AttentionShape shape;  // batch = the head dims; n = query rows, m = the cache's rows (or block size)
  int64_t batch = 0;     // B
  std::vector<int64_t> seqlens, leftpad, cache_row;  // per batch entry, host copies
  bool paged = false;
  int64_t block_size = 0, num_blocks = 0;
  std::optional<at::Tensor> block_table;  // int32 (B, max_blocks), contiguous
  // ALiBi slopes with a leading per-batch dim: the elements between two entries' slopes (else 0).
  int64_t slopes_batch_stride = 0;
  LogitOptions logit;
};

// Checks every argument (shapes, dtypes, devices; seqlens within the cache, leftpad within
// seqlens, cache rows and block ids within the cache) and reads the per-entry values to the host.
KVCacheCall check_kv_cache_inputs(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& cache_batch_idx,
                                  const std::optional<at::Tensor>& cache_leftpad,
                                  const std::optional<at::Tensor>& block_table, double scale,
                                  const LogitOptions& logit);

// A KV-cache forward ready for a device's kernels: the outputs and one dense call per batch entry.
// Calls of at most `paged_rows` query rows read a paged cache through its block table (the CPU
// decode kernel's paging; 0: never); the others get a contiguous copy of their blocks, kept alive
// in `scratch` while the calls run.
struct KVCacheForward {
  at::Tensor out, lse;
  std::vector<AttentionParams> entries;
  std::vector<at::Tensor> scratch;
};
KVCacheForward prepare_kv_cache_forward(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                        const at::Tensor& cache_seqlens,
                                        const std::optional<at::Tensor>& cache_batch_idx,
                                        const std::optional<at::Tensor>& cache_leftpad,
                                        const std::optional<at::Tensor>& block_table, double scale,
                                        const LogitOptions& logit, int64_t paged_rows);

// A per-entry int32 argument of shape (batch,) (cache_seqlens, cache_leftpad, cache_batch_idx, the
// rotary's start positions), checked (dtype, shape, on q's device or the CPU) and read to the host.
std::vector<int64_t> read_per_entry(const at::Tensor& t, const char* name, int64_t batch, const at::Tensor& q);

// Writes new keys and values into the caches in place (FlashAttention's append): k / v (B, new,
// kv_heads, d) row t of entry b goes to position cache_seqlens[b] + t of cache row
// cache_batch_idx[b] (default b) of a (B_cache, S_max, kv_heads, d) cache, or, paged, to slot
// position % block_size of block block_table[b][position / block_size] of a (num_blocks,
// block_size, kv_heads, d) one. Every position is checked to lie in the cache before anything is
// written. CPU caches only, written row by row in place: a decode step's few rows, with no index
// tensors to build (flash_attn_with_kvcache appends to caches on other devices with index_put_).
void kv_cache_append(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& cache_batch_idx,
                     const std::optional<at::Tensor>& block_table);

}  // namespace attention_ext
