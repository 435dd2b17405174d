// flash_attn_with_kvcache's eager decode step on CPU tensors in one C++ call (attention_ext/kv_cache.py
// takes traced calls, and those under forward-mode AD or a functorch transform): the package's
// argument checks, the rotary embedding of q and the new keys (rotary.h, through the op), the
// in-place append of the new keys and values, the views the attention op takes and the op itself. A decode step of a small model is a few microseconds of
// kernel; in Python the same checks and views cost about twice that again (benchmarks/README.md).
//
// The step never raises an error of its own: any argument the Python path would refuse, or that
// this path does not take, makes it answer nullopt *before anything is written*, and the caller
// runs the Python path, which raises its error (or computes the call). So the messages stay in one
// place, and a call gives the same result, bits and cache contents either way (tests/test_kv_cache.py
// checks both paths against each other).
#pragma once
#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace attention_ext {

struct KVCacheStepArgs {
  at::Tensor q, k_cache, v_cache;                // (B, Sq, heads, d), (rows | blocks, S | block_size, kv_heads, d)
  std::optional<at::Tensor> k, v;                // the new keys and values (B, S_new, kv_heads, d), or none
  std::optional<at::Tensor> rotary_cos, rotary_sin;  // (seqlen_ro, rotary_dim / 2), float64/32/16, bf16
  std::optional<at::Tensor> seqlens;             // cache_seqlens as an int32 (B,) tensor,
  std::optional<int64_t> seqlens_all;            // or as one int for every entry (neither: every cache full)
  std::optional<at::Tensor> batch_idx, leftpad;  // int32 (B,)
  std::optional<at::Tensor> block_table;         // int32 (B, max_blocks): a paged cache
  std::optional<double> scale;                   // softmax_scale (none: 1 / sqrt(d))
  bool causal = false;
  int64_t window_left = -1, window_right = -1;   // window_size as given (-1: unbounded)
  double softcap = 0.0;                          // (0: none)
  std::optional<at::Tensor> alibi_slopes;        // float32 (heads,) or (B, heads)
  bool rotary_interleaved = true;                // pairs (2i, 2i + 1), else the halves (GPT-NeoX)
};

// (out (B, Sq, heads, d_v), lse (B, heads, Sq)), or nullopt: the Python path decides.
std::optional<std::tuple<at::Tensor, at::Tensor>> kv_cache_step(const KVCacheStepArgs& a);

}  // namespace attention_ext
