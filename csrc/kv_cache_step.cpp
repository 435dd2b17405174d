#include "kv_cache_step.h"

#include "kv_cache.h"
#include "op_arguments.h"
#include "op_handles.h"

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace attention_ext {

namespace {

using op_handles::OptTensor;

// An optional per-entry argument as flash_attn_with_kvcache takes it: int32 (batch,) on the CPU.
bool per_entry_ok(const OptTensor& t, int64_t batch) {
  return !t.has_value() ||
         (t->scalar_type() == at::kInt && t->dim() == 1 && t->size(0) == batch && t->device().is_cpu());
}

std::vector<int64_t> per_entry_values(const at::Tensor& t) {
  const auto values = t.accessor<int32_t, 1>();
  std::vector<int64_t> out(values.size(0));
  for (int64_t b = 0; b < values.size(0); ++b) out[b] = values[b];
  return out;
}

// Whether two entries' new keys go to one cache slot (kv_cache.py's _check_one_writer): each
// entry's positions [lengths[b], lengths[b] + new) cut at its blocks (paged) or in its cache row.
bool two_writers(const std::vector<int64_t>& lengths, const std::vector<int64_t>& rows,
                 const std::optional<at::TensorAccessor<int32_t, 2>>& table, int64_t block_size, int64_t new_keys) {
  struct Piece {
    int64_t where, first, end;
  };
  std::vector<Piece> pieces;
  for (size_t b = 0; b < lengths.size(); ++b) {
    const int64_t length = lengths[b];
    if (!table.has_value()) {
      pieces.push_back({rows.empty() ? int64_t(b) : rows[b], length, length + new_keys});
      continue;
    }
    for (int64_t j = length / block_size; j <= (length + new_keys - 1) / block_size; ++j)
      pieces.push_back({(*table)[b][j], std::max(length, j * block_size) - j * block_size,
                        std::min(length + new_keys, (j + 1) * block_size) - j * block_size});
  }
  std::sort(pieces.begin(), pieces.end(), [](const Piece& x, const Piece& y) {
    return x.where != y.where ? x.where < y.where : x.first < y.first;
  });
  for (size_t i = 1; i < pieces.size(); ++i)
    if (pieces[i].where == pieces[i - 1].where && pieces[i].first < pieces[i - 1].end) return true;
  return false;
}

at::Tensor int32_tensor(const std::vector<int64_t>& values) {
  at::Tensor t = at::empty({static_cast<int64_t>(values.size())}, at::TensorOptions().dtype(at::kInt));
  int32_t* p = t.data_ptr<int32_t>();
  for (size_t i = 0; i < values.size(); ++i) p[i] = static_cast<int32_t>(values[i]);
  return t;
}

// A (rows or blocks, length, kv_heads, d) cache as the view (rows, kv_heads, 1, length, d).
at::Tensor heads_first(const at::Tensor& cache) {
  return cache.as_strided({cache.size(0), cache.size(2), 1, cache.size(1), cache.size(3)},
                          {cache.stride(0), cache.stride(2), 0, cache.stride(1), cache.stride(3)});
}

}  // namespace

std::optional<std::tuple<at::Tensor, at::Tensor>> kv_cache_step(const KVCacheStepArgs& a) {
  const at::Tensor &q = a.q, &k_cache = a.k_cache, &v_cache = a.v_cache;
  const bool append = a.k.has_value();
  // The tensors (kv_cache.py's _check_tensors): 4-D, one float dtype, all on the CPU, none
  // requiring grad where grad mode would record, the caches' shapes matching q's and each other's.
  // (An active torch dispatch mode, e.g. FakeTensorMode over real inputs, gets the Python path: the
  // step reads the per-entry values and writes int32 tensors it would hand the mode.)
  if (append != a.v.has_value() || c10::impl::TorchDispatchModeTLS::stack_len() > 0) return std::nullopt;
  std::vector<const at::Tensor*> inputs{&q, &k_cache, &v_cache};
  if (append) inputs.insert(inputs.end(), {&*a.k, &*a.v});
  std::vector<const at::Tensor*> all = inputs;
  for (const OptTensor* t :
       {&a.seqlens, &a.batch_idx, &a.leftpad, &a.block_table, &a.alibi_slopes, &a.rotary_cos, &a.rotary_sin})
    if (t->has_value()) all.push_back(&**t);
  for (const at::Tensor* t : all)  // (dense tensors only: no sparse, mkldnn or nested layout)
    if (t->layout() != at::kStrided || t->is_nested()) return std::nullopt;
  const bool grad_mode = c10::GradMode::is_enabled();
  for (const at::Tensor* t : inputs)
    if (t->dim() != 4 || t->scalar_type() != q.scalar_type() || !t->device().is_cpu() ||
        (grad_mode && t->requires_grad()))
      return std::nullopt;
  if (!supported_dtype(q.scalar_type())) return std::nullopt;
  const int64_t batch = q.size(0), seqlen_q = q.size(1), heads = q.size(2), d = q.size(3);
  const int64_t cache_rows = k_cache.size(0), cache_length = k_cache.size(1), kv_heads = k_cache.size(2);
  if (batch == 0 || k_cache.size(0) != v_cache.size(0) || k_cache.size(1) != v_cache.size(1) ||
      k_cache.size(2) != v_cache.size(2) || k_cache.size(3) != d || kv_heads <= 0 || heads % kv_heads != 0)
    return std::nullopt;
  const int64_t new_keys = append ? a.k->size(1) : 0;
  if (append) {
    const at::Tensor &k = *a.k, &v = *a.v;
    if (k.size(0) != batch || k.size(2) != kv_heads || k.size(3) != d || v.size(0) != batch ||
        v.size(1) != new_keys || v.size(2) != kv_heads || v.size(3) != v_cache.size(3))
      return std::nullopt;
    // an expanded cache (one memory row for several entries), or an inference tensor outside
    // inference mode: refused by the Python path
    for (const at::Tensor* cache : {&k_cache, &v_cache}) {
      for (int64_t dim = 0; dim < 4; ++dim)
        if (cache->stride(dim) == 0 && cache->size(dim) > 1) return std::nullopt;
      if (!c10::InferenceMode::is_enabled() && cache->is_inference()) return std::nullopt;
    }
    // caches that are one memory (refused there), or new rows that are a view of a cache (copied
    // there before they are written)
    if (same_memory(k_cache, v_cache)) return std::nullopt;
    for (const at::Tensor* rows : {&k, &v})
      for (const at::Tensor* cache : {&k_cache, &v_cache})
        if (may_share_memory(*rows, *cache)) return std::nullopt;
  }
  // The cache's capacity and the per-entry arguments (_check_per_entry, the block table's rules).
  const bool paged = a.block_table.has_value();
  int64_t capacity = cache_length;
  if (paged) {
    const at::Tensor& table = *a.block_table;
    if (cache_rows == 0 || cache_length == 0 || table.scalar_type() != at::kInt || table.dim() != 2 ||
        table.size(0) != batch || !table.device().is_cpu() || a.batch_idx.has_value())
      return std::nullopt;
    if (__builtin_mul_overflow(table.size(1), cache_length, &capacity)) return std::nullopt;
  }
  if (!per_entry_ok(a.seqlens, batch) || !per_entry_ok(a.batch_idx, batch) || !per_entry_ok(a.leftpad, batch))
    return std::nullopt;
  const bool seqlens_given = a.seqlens.has_value() || a.seqlens_all.has_value();
  if (append && !seqlens_given) return std::nullopt;  // (where the new keys go is not known)
  // Every position an entry writes or reads, before anything is written (_check_entries).
  const std::vector<int64_t> lengths = a.seqlens.has_value() ? per_entry_values(*a.seqlens)
                                       : std::vector<int64_t>(batch, a.seqlens_all.value_or(capacity));
  const std::vector<int64_t> leftpad = a.leftpad.has_value() ? per_entry_values(*a.leftpad)
                                                             : std::vector<int64_t>(batch, 0);
  const std::vector<int64_t> rows = a.batch_idx.has_value() ? per_entry_values(*a.batch_idx)
                                                             : std::vector<int64_t>();
  const std::optional<at::TensorAccessor<int32_t, 2>> table =
      paged ? std::make_optional(a.block_table->accessor<int32_t, 2>()) : std::nullopt;
  for (int64_t b = 0; b < batch; ++b) {
    int64_t end = 0;
    if (__builtin_add_overflow(lengths[b], new_keys, &end) || lengths[b] < 0 || end > capacity ||
        end >= (int64_t{1} << 31) || leftpad[b] < 0 || leftpad[b] > end)
      return std::nullopt;
    const int64_t row = rows.empty() ? b : rows[b];
    if (!paged && (row < 0 || row >= cache_rows)) return std::nullopt;
    if (paged) {  // every block the entry reads or writes, in the cache
      const int64_t stop = end > 0 ? (end - 1) / cache_length + 1 : 0;  // (end <= capacity: within the table)
      for (int64_t j = std::min(leftpad[b], lengths[b]) / cache_length; j < stop; ++j)
        if ((*table)[b][j] < 0 || (*table)[b][j] >= cache_rows) return std::nullopt;
    }
  }
  // Two entries appending to one slot: refused by the Python path.
  if (new_keys > 0 && (paged || !rows.empty()) && two_writers(lengths, rows, table, cache_length, new_keys))
    return std::nullopt;
  // ALiBi slopes: one per query head, or per entry and query head (flash.py's _check_alibi).
  OptTensor slopes;
  if (a.alibi_slopes.has_value()) {
    const at::Tensor& s = *a.alibi_slopes;
    const bool per_head = s.dim() == 1 && s.size(0) == heads;
    const bool per_entry = s.dim() == 2 && s.size(0) == batch && s.size(1) == heads;
    if (s.scalar_type() != at::kFloat || !(per_head || per_entry) || !s.device().is_cpu() ||
        (grad_mode && s.requires_grad()))
      return std::nullopt;
    slopes = s.detach().unflatten(-1, {kv_heads, heads / kv_heads});
  }
  // FlashAttention's window (-1: unbounded), causal its right side 0; a side at least the cache's
  // capacity long bounds nothing.
  if (a.window_left < -1 || a.window_right < -1 || a.window_left > kMaxWindow || a.window_right > kMaxWindow)
    return std::nullopt;
  const int64_t window_left = a.window_left >= capacity ? -1 : a.window_left;
  const int64_t right = a.causal ? 0 : a.window_right;
  const int64_t window_right = right >= capacity ? -1 : right;
  // softcap 0 (none) or within every dtype's rule (_arguments.softcap_rules)
  if (!(a.softcap == 0.0 || (a.softcap >= 1e-30 && a.softcap <= 1e30))) return std::nullopt;
  // Rotary tables: both, with new keys to rotate; float64/32/16 or bf16 (the rotary op's; other
  // float dtypes take the Python path's torch ops) on the CPU, (seqlen_ro, rotary_dim / 2) with
  // rotary_dim <= d, every position they rotate within them (kv_cache.py's _check_rotary_reach).
  // FlashAttention rotates q row by row at its rows' positions only for a causal or windowed call
  // (the window sides after the capacity rule), else every row at the entry's start.
  const bool rotary = a.rotary_cos.has_value() || a.rotary_sin.has_value();
  const bool rotary_local = a.causal || window_left >= 0 || window_right >= 0;
  if (rotary) {
    if (!a.rotary_cos.has_value() || !a.rotary_sin.has_value() || !append) return std::nullopt;
    const at::Tensor &cos = *a.rotary_cos, &sin = *a.rotary_sin;
    for (const at::Tensor* t : {&cos, &sin})
      if (!supported_dtype(t->scalar_type()) || !t->device().is_cpu() || t->dim() != 2 ||
          (grad_mode && t->requires_grad()))
        return std::nullopt;
    if (cos.sizes() != sin.sizes() || 2 * cos.size(1) > d) return std::nullopt;
    const int64_t longest = *std::max_element(lengths.begin(), lengths.end());  // (batch > 0)
    const int64_t last = std::max(new_keys > 0 ? longest + new_keys - 1 : int64_t{-1},
                                  seqlen_q > 0 ? longest + (rotary_local ? seqlen_q - 1 : 0) : int64_t{-1});
    if (last >= cos.size(0)) return std::nullopt;
  }
  const double scale = a.scale.has_value() ? *a.scale : default_scale(d);

  at::Tensor out, lse;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;  // (the ops record nothing: no input requires grad here)
    // Where each entry's new keys go (and the positions rotary rotates them at).
    const at::Tensor starts = append ? (a.seqlens.has_value() ? *a.seqlens : int32_tensor(lengths)) : at::Tensor();
    at::Tensor q_rows = q, k_rows = append ? *a.k : at::Tensor();
    if (rotary) {  // (the tables detached, as in Python: nothing here records a graph)
      const auto& rotate = op_handles::handle<op_handles::RotarySig, op_handles::kRotary>();
      const at::Tensor cos = a.rotary_cos->detach(), sin = a.rotary_sin->detach();
      k_rows = rotate.call(k_rows, cos, sin, starts, true, a.rotary_interleaved);
      q_rows = rotate.call(q, cos, sin, starts, rotary_local, a.rotary_interleaved);
    }
    if (append && new_keys > 0) {  // (no rows: nothing written, no version bump, as in Python)
      op_handles::handle<op_handles::KVCacheAppendSig, op_handles::kKVCacheAppend>()
          .call(k_cache, v_cache, k_rows, *a.v, starts, a.batch_idx, a.block_table);  // (it bumps their versions)
    }
    std::vector<int64_t> ends;
    if (new_keys > 0 || !a.seqlens.has_value()) {
      ends.resize(batch);
      for (int64_t b = 0; b < batch; ++b) ends[b] = lengths[b] + new_keys;
    }
    // (batch, kv_heads, groups, Sq, d) against K/V (rows, kv_heads, 1, length, d): the query heads
    // sharing a K/V head as one item's rows (attention_ext/kv_cache.py).
    const int64_t groups = heads / kv_heads;
    const at::Tensor qh =
        q_rows.as_strided({batch, kv_heads, groups, seqlen_q, d},
                          {q_rows.stride(0), q_rows.stride(2) * groups, q_rows.stride(2), q_rows.stride(1),
                           q_rows.stride(3)});
    std::tie(out, lse) = op_handles::handle<op_handles::KVCacheFwdSig, op_handles::kKVCacheFwd>()
                             .call(qh, heads_first(k_cache), heads_first(v_cache),
                                   ends.empty() ? *a.seqlens : int32_tensor(ends), a.batch_idx, a.leftpad,
                                   a.block_table, scale, a.causal ? 2 : 0, window_left, window_right, a.softcap,
                                   slopes);
  }
  // (the views of the outputs made above the autograd keys, as the Python path makes them)
  return std::make_tuple(out.permute({0, 3, 1, 2, 4}).flatten(2, 3), lse.flatten(1, 2));
}

}  // namespace attention_ext
