#include "kv_cache.h"

#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>

namespace attention_ext {

namespace {
// The bytes a strided tensor's elements lie in, [first, end) (none for no elements).
std::pair<uintptr_t, uintptr_t> byte_span(const at::Tensor& t) {
  if (t.numel() == 0) return {0, 0};
  int64_t last = 0;
  for (int64_t dim = 0; dim < t.dim(); ++dim) last += (t.size(dim) - 1) * t.stride(dim);
  const auto first = reinterpret_cast<uintptr_t>(t.data_ptr());
  return {first, first + static_cast<uintptr_t>((last + 1) * t.element_size())};
}
}  // namespace

bool may_share_memory(const at::Tensor& a, const at::Tensor& b) {
  const auto [a0, a1] = byte_span(a);
  const auto [b0, b1] = byte_span(b);
  return a0 < b1 && b0 < a1;
}

namespace {
// Whether views a and b with the same strides (and element size) have an element in common:
// index x of a and y of b with sum_i stride_i·(x_i − y_i) = b's first element − a's. The
// differences are found dim by dim, largest stride first, each among the values that leave a
// remainder the smaller strides can still make (one or two where the strides nest, as slices of
// one tensor's do). Other strides, or a search past its budget: false (not decided).
constexpr int64_t kMeetSearchBudget = 4096;
struct StridedMeet {
  struct Dim {
    int64_t stride, high, low;  // x − y in [low, high]
  };
  std::vector<Dim> dims;
  std::vector<int64_t> reach_low, reach_high;  // the sums dims[i:] can reach
  int64_t budget = kMeetSearchBudget;

  bool meet(size_t i, int64_t rest) {
    if (i == dims.size()) return rest == 0;
    const Dim& dim = dims[i];
    const int64_t first = std::max(dim.low, -floor_div(reach_high[i + 1] - rest, dim.stride));
    const int64_t last = std::min(dim.high, floor_div(rest - reach_low[i + 1], dim.stride));
    for (int64_t d = first; d <= last; ++d) {
      if (--budget < 0) return false;  // (the whole search stops here)
      if (meet(i + 1, rest - dim.stride * d)) return true;
    }
    return false;
  }
  static int64_t floor_div(int64_t a, int64_t b) { return a / b - ((a % b != 0) && ((a < 0) != (b < 0))); }
};

bool strided_views_meet(const at::Tensor& a, const at::Tensor& b) {
  const int64_t size = a.element_size();
  const int64_t distance = reinterpret_cast<intptr_t>(b.data_ptr()) - reinterpret_cast<intptr_t>(a.data_ptr());
  if (size != b.element_size() || a.dim() != b.dim() || distance % size != 0) return false;
  StridedMeet search;
  for (int64_t dim = 0; dim < a.dim(); ++dim) {
    if (a.size(dim) <= 1 && b.size(dim) <= 1) continue;  // (any stride there: it says nothing)
    if (a.stride(dim) != b.stride(dim)) return false;
    if (a.stride(dim) != 0) search.dims.push_back({a.stride(dim), a.size(dim) - 1, 1 - b.size(dim)});
  }
  std::sort(search.dims.begin(), search.dims.end(), [](const StridedMeet::Dim& x, const StridedMeet::Dim& y) {
    if (x.stride != y.stride) return x.stride > y.stride;
    return x.high != y.high ? x.high > y.high : x.low > y.low;  // (the Python twin's order)
  });
  search.reach_low.assign(search.dims.size() + 1, 0);
  search.reach_high.assign(search.dims.size() + 1, 0);
  for (size_t i = search.dims.size(); i-- > 0;) {
    search.reach_high[i] = search.reach_high[i + 1] + search.dims[i].stride * search.dims[i].high;
    search.reach_low[i] = search.reach_low[i + 1] + search.dims[i].stride * search.dims[i].low;
  }
  return search.meet(0, distance / size);
}
}  // namespace

bool same_memory(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0 || !may_share_memory(a, b)) return false;
  return a.data_ptr() == b.data_ptr() ||
         (a.is_non_overlapping_and_dense() && b.is_non_overlapping_and_dense()) || strided_views_meet(a, b);
}

// A per-entry int32 vector argument (B,), on q's device or the CPU, read to the host (kv_cache.h).
std::vector<int64_t> read_per_entry(const at::Tensor& t, const char* name, int64_t batch, const at::Tensor& q) {
  TORCH_CHECK(t.scalar_type() == at::kInt, "attention_ext: ", name, " must be int32, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && t.size(0) == batch, "attention_ext: ", name, " must have shape (", batch,
              ",) (one entry per batch row of the query), got ", t.sizes());
  TORCH_CHECK(t.device().is_cpu() || t.device() == q.device(), "attention_ext: ", name, " must be on ", q.device(),
              " (or the CPU), got ", t.device());
  const at::Tensor host = t.to(at::kCPU, at::kLong).contiguous();
  return std::vector<int64_t>(host.data_ptr<int64_t>(), host.data_ptr<int64_t>() + batch);
}

namespace {

// block_table (B, max_blocks) int32, on the query's (or cache's) device or the CPU, checked and
// copied to the host.
at::Tensor read_block_table(const at::Tensor& bt, int64_t batch, const at::Tensor& q) {
  TORCH_CHECK(bt.scalar_type() == at::kInt && bt.dim() == 2 && bt.size(0) == batch,
              "attention_ext: block_table must be int32 of shape (", batch, ", max_blocks), got ", bt.scalar_type(),
              " of shape ", bt.sizes());
  TORCH_CHECK(bt.device().is_cpu() || bt.device() == q.device(), "attention_ext: block_table must be on ", q.device(),
              " (or the CPU), got ", bt.device());
  return bt.to(at::kCPU).contiguous();
}

}  // namespace

KVCacheCall check_kv_cache_inputs(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& cache_batch_idx,
                                  const std::optional<at::Tensor>& cache_leftpad,
                                  const std::optional<at::Tensor>& block_table, double scale,
                                  const LogitOptions& logit) {
  KVCacheCall call;
  call.logit = logit;
  TORCH_CHECK(q.dim() >= 3, "attention_ext: query must be (batch, heads..., n, d) for a KV-cache call, got shape ",
              q.sizes());
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{k_cache, "k_cache"}, {v_cache, "v_cache"}})
    TORCH_CHECK(t.dim() == q.dim(), "attention_ext: ", name, " must have as many dims as the query (", q.dim(),
                "): (cache rows or blocks, heads..., length, d), got shape ", t.sizes());
  TORCH_CHECK(k_cache.size(0) == v_cache.size(0) && k_cache.size(-2) == v_cache.size(-2),
              "attention_ext: k_cache and v_cache must have the same rows (or blocks) and length, got ",
              k_cache.sizes(), " and ", v_cache.sizes());
  TORCH_CHECK(logit.causal != 1, "attention_ext: a KV-cache call aligns causal masks and windows bottom-right ",
              "(causal = 2); top-left causal (1) is not supported for it");
  call.batch = q.size(0);
  call.paged = block_table.has_value();
  const int64_t cache_rows = k_cache.size(0), length = k_cache.size(-2);
  TORCH_CHECK(call.batch == 0 || cache_rows > 0, "attention_ext: the KV cache has no ",
              call.paged ? "blocks" : "rows", " (k_cache of shape ", k_cache.sizes(), ")");
  // Per-batch ALiBi slopes: one dim more than the head dims.
  if (logit.alibi_slopes.has_value() && logit.alibi_slopes->dim() == q.dim() - 2) {
    const at::Tensor& slopes = *logit.alibi_slopes;
    TORCH_CHECK(slopes.size(0) == call.batch || slopes.size(0) == 1, "attention_ext: per-batch alibi_slopes of shape ",
                slopes.sizes(), " must have one row per batch entry (", call.batch, ")");
    call.slopes_batch_stride = slopes.size(0) == 1 ? 0 : slopes.stride(0);
    if (slopes.size(0) == 0)
      call.logit.alibi_slopes.reset();
    else
      call.logit.alibi_slopes = slopes.select(0, 0);
  }
  if (call.batch > 0) {
    call.shape = check_attention_inputs(q.select(0, 0), k_cache.select(0, 0), v_cache.select(0, 0), std::nullopt,
                                        scale, call.logit, 0.0, std::nullopt);
  }
  call.seqlens = read_per_entry(cache_seqlens, "cache_seqlens", call.batch, q);
  call.leftpad = cache_leftpad.has_value() ? read_per_entry(*cache_leftpad, "cache_leftpad", call.batch, q)
                                           : std::vector<int64_t>(call.batch, 0);
  call.cache_row.resize(call.batch);
  for (int64_t b = 0; b < call.batch; ++b) call.cache_row[b] = b;
  if (cache_batch_idx.has_value()) {
    TORCH_CHECK(!call.paged, "attention_ext: cache_batch_idx cannot be combined with a paged cache (block_table ",
                "already names each entry's blocks)");
    call.cache_row = read_per_entry(*cache_batch_idx, "cache_batch_idx", call.batch, q);
    for (int64_t b = 0; b < call.batch; ++b)
      TORCH_CHECK(call.cache_row[b] >= 0 && call.cache_row[b] < cache_rows, "attention_ext: cache_batch_idx[", b,
                  "] = ", call.cache_row[b], " is outside the cache's ", cache_rows, " rows");
  } else if (!call.paged) {
    TORCH_CHECK(call.batch <= cache_rows, "attention_ext: the query has ", call.batch, " batch entries but the cache ",
                "only ", cache_rows, " rows (pass cache_batch_idx to pick rows)");
  }
  int64_t capacity = length;
  std::vector<int64_t> table;
  if (call.paged) {
    call.block_table = read_block_table(*block_table, call.batch, q);
    TORCH_CHECK(length >= 1, "attention_ext: a paged cache needs blocks of at least one row, got k_cache of shape ",
                k_cache.sizes());
    call.block_size = length;
    call.num_blocks = cache_rows;
    capacity = call.block_table->size(1) * length;
    const int32_t* ids = call.block_table->data_ptr<int32_t>();
    table.assign(ids, ids + call.block_table->numel());
  }
  for (int64_t b = 0; b < call.batch; ++b) {
    const int64_t end = call.seqlens[b], begin = call.leftpad[b];
    TORCH_CHECK(end >= 0 && end <= capacity, "attention_ext: cache_seqlens[", b, "] = ", end, " (the keys the entry ",
                "attends to, any appended ones included) must be in [0, ", capacity, "], the cache's capacity");
    TORCH_CHECK(begin >= 0 && begin <= end, "attention_ext: cache_leftpad[", b, "] = ", begin,
                " must be in [0, cache_seqlens[", b, "] = ", end, "]");
    if (!call.paged || end == begin) continue;
    const int64_t per_entry = block_table->size(1);
    for (int64_t blk = begin / length; blk <= (end - 1) / length; ++blk) {
      const int64_t id = table[b * per_entry + blk];
      TORCH_CHECK(id >= 0 && id < call.num_blocks, "attention_ext: block_table[", b, ", ", blk, "] = ", id,
                  " is outside the cache's ", call.num_blocks, " blocks");
    }
  }
  return call;
}

namespace {

std::pair<at::Tensor, at::Tensor> allocate_kv_cache_outputs(const KVCacheCall& call, const at::Tensor& q) {
  const std::vector<int64_t>& heads = call.shape.batch;
  const int64_t n = call.batch > 0 ? call.shape.n : q.size(-2);
  const int64_t dv = call.batch > 0 ? call.shape.dv : q.size(-1);
  std::vector<int64_t> rows_first{call.batch, n};
  rows_first.insert(rows_first.end(), heads.begin(), heads.end());
  rows_first.push_back(dv);
  std::vector<int64_t> order{0};
  for (size_t d = 0; d < heads.size(); ++d) order.push_back(static_cast<int64_t>(d) + 2);
  order.push_back(1);
  order.push_back(static_cast<int64_t>(heads.size()) + 2);
  at::Tensor out = at::empty(rows_first, q.options()).permute(order);
  std::vector<int64_t> lse_shape{call.batch};
  lse_shape.insert(lse_shape.end(), heads.begin(), heads.end());
  lse_shape.push_back(n);
  return {out, at::empty(lse_shape, q.options().dtype(lse_dtype(q.scalar_type())))};
}

// One dense call per batch entry (see prepare_kv_cache_forward).
std::vector<AttentionParams> kv_cache_params(const KVCacheCall& call, const at::Tensor& q, const at::Tensor& k_cache,
                                             const at::Tensor& v_cache, const at::Tensor& out, const at::Tensor& lse,
                                             double scale, bool page, std::vector<at::Tensor>* scratch) {
  std::vector<AttentionParams> calls;
  if (call.batch == 0) return calls;
  const std::vector<int64_t>& heads = call.shape.batch;
  AttentionParams base = make_params(call.shape, q.select(0, 0), k_cache.select(0, 0), v_cache.select(0, 0),
                                     std::nullopt, scale, call.logit, 0.0, std::nullopt);
  base.out = make_ref(out.select(0, 0), heads);
  base.lse = make_row_ref(lse.select(0, 0), heads);
  const int64_t values = value_bytes(base.dtype), stats = stat_bytes(base.dtype);
  for (int64_t b = 0; b < call.batch; ++b) {
    AttentionParams p = base;
    const int64_t begin = call.leftpad[b], end = call.seqlens[b];
    p.m = end - begin;
    advance_elements(p.q, b * q.stride(0), values);
    advance_elements(p.out, b * out.stride(0), values);
    advance_elements(p.lse, b * lse.stride(0), stats);
    advance_elements(p.alibi_slopes, b * call.slopes_batch_stride, sizeof(float));
    if (!call.paged) {
      advance_elements(p.k, call.cache_row[b] * k_cache.stride(0) + begin * k_cache.stride(-2), values);
      advance_elements(p.v, call.cache_row[b] * v_cache.stride(0) + begin * v_cache.stride(-2), values);
    } else if (page) {
      p.key_blocks = call.block_table->data_ptr<int32_t>() + b * call.block_table->size(1);
      p.block_size = call.block_size;
      p.key_offset = begin;
      p.k_block_stride = k_cache.stride(0);
      p.v_block_stride = v_cache.stride(0);
    } else if (p.m > 0) {
      // The entry's blocks, in order, copied into one (heads..., blocks·block_size, d) tensor.
      const int64_t first = begin / call.block_size, last = (end - 1) / call.block_size;
      const at::Tensor ids = call.block_table->select(0, b).narrow(0, first, last - first + 1)
                                 .to(at::kLong).to(k_cache.device());
      const int64_t rows_dim = k_cache.dim() - 3;  // the block dim, moved next to the rows
      for (const auto& [cache, ref] : {std::pair<const at::Tensor&, TensorRef*>{k_cache, &p.k}, {v_cache, &p.v}}) {
        const at::Tensor keys = cache.movedim(0, rows_dim).index_select(rows_dim, ids).flatten(rows_dim, rows_dim + 1);
        scratch->push_back(keys);
        *ref = make_ref(keys, heads);
        advance_elements(*ref, (begin - first * call.block_size) * keys.stride(-2), values);
      }
    }
    calls.push_back(p);
  }
  return calls;
}

}  // namespace

KVCacheForward prepare_kv_cache_forward(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                        const at::Tensor& cache_seqlens,
                                        const std::optional<at::Tensor>& cache_batch_idx,
                                        const std::optional<at::Tensor>& cache_leftpad,
                                        const std::optional<at::Tensor>& block_table, double scale,
                                        const LogitOptions& logit, int64_t paged_rows) {
  const KVCacheCall call = check_kv_cache_inputs(q, k_cache, v_cache, cache_seqlens, cache_batch_idx, cache_leftpad,
                                                 block_table, scale, logit);
  KVCacheForward forward;
  std::tie(forward.out, forward.lse) = allocate_kv_cache_outputs(call, q);
  if (forward.lse.numel() == 0) return forward;
  // The host copy of the block table the kernels read (a copy when the caller's is on the GPU or
  // not contiguous) lives as long as the calls.
  if (call.block_table.has_value()) forward.scratch.push_back(*call.block_table);
  forward.entries = kv_cache_params(call, q, k_cache, v_cache, forward.out, forward.lse, scale,
                                    call.shape.n <= paged_rows, &forward.scratch);
  return forward;
}

namespace {

// One row of d elements of `bytes` each, from src (stride src_step elements) to dst (dst_step).
void copy_row(char* dst, int64_t dst_step, const char* src, int64_t src_step, int64_t d, int64_t bytes) {
  if (dst_step == 1 && src_step == 1) {
    std::memcpy(dst, src, static_cast<size_t>(d * bytes));
    return;
  }
  for (int64_t c = 0; c < d; ++c) std::memcpy(dst + c * dst_step * bytes, src + c * src_step * bytes, bytes);
}

}  // namespace

void kv_cache_append(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& cache_batch_idx,
                     const std::optional<at::Tensor>& block_table) {
  const bool paged = block_table.has_value();
  for (const auto& [cache, name] : {std::pair<const at::Tensor&, const char*>{k_cache, "k_cache"}, {v_cache, "v_cache"}})
    TORCH_CHECK(cache.dim() == 4, "attention_ext: ", name, " must be 4-D ", paged ? "(num_blocks, block_size" :
                "(batch, seqlen", ", kv_heads, head_dim) to append to, got shape ", cache.sizes());
  TORCH_CHECK(k.dim() == 4 && v.dim() == 4 && k.size(0) == v.size(0) && k.size(1) == v.size(1) &&
                  k.sizes().slice(2) == k_cache.sizes().slice(2) && v.sizes().slice(2) == v_cache.sizes().slice(2),
              "attention_ext: k and v must be (batch, seqlen_new, kv_heads, head_dim) with the caches' last two dims, ",
              "got k ", k.sizes(), " and v ", v.sizes(), " for k_cache ", k_cache.sizes(), " and v_cache ",
              v_cache.sizes());
  TORCH_CHECK(k_cache.size(0) == v_cache.size(0) && k_cache.size(1) == v_cache.size(1) &&
                  k_cache.size(2) == v_cache.size(2),
              "attention_ext: k_cache and v_cache must share their first three dims, got ", k_cache.sizes(), " and ",
              v_cache.sizes());
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{v_cache, "v_cache"}, {k, "k"}, {v, "v"}})
    TORCH_CHECK(t.scalar_type() == k_cache.scalar_type() && t.device() == k_cache.device(), "attention_ext: ", name,
                " must have k_cache's dtype and device (", k_cache.scalar_type(), ", ", k_cache.device(), "), got ",
                t.scalar_type(), ", ", t.device());
  TORCH_CHECK(k_cache.device().is_cpu(), "attention_ext: attention_kvcache_append writes CPU caches (on other ",
              "devices flash_attn_with_kvcache appends with index_put_), got ", k_cache.device());
  // An in-place update, with torch's rules for one: no cache that requires grad while grad mode is
  // on, no inference tensor outside inference mode, no cache several of whose elements are one
  // memory place (stride 0), and K and V not one memory.
  for (const auto& [cache, name] :
       {std::pair<const at::Tensor&, const char*>{k_cache, "k_cache"}, {v_cache, "v_cache"}}) {
    TORCH_CHECK(!(c10::GradMode::is_enabled() && cache.requires_grad()), "attention_ext: ", name,
                " requires grad: the append writes it in place (call it under torch.no_grad())");
    TORCH_CHECK(!cache.is_inference() || c10::InferenceMode::is_enabled(), "attention_ext: ", name,
                " is an inference tensor: appending to it in place works only under torch.inference_mode()");
    for (int64_t dim = 0; dim < 4; ++dim)
      TORCH_CHECK_VALUE(cache.stride(dim) != 0 || cache.size(dim) <= 1, "attention_ext: ", name,
                        " is an expanded view (stride 0 in dim ", dim, ", shape ", cache.sizes(),
                        "): appending would write one memory place for several elements");
  }
  TORCH_CHECK_VALUE(!same_memory(k_cache, v_cache), "attention_ext: k_cache and v_cache are the same memory: ",
                    "appending would write each over the other");
  const int64_t batch = k.size(0), fresh = k.size(1), heads = k.size(2);
  const std::vector<int64_t> start = read_per_entry(cache_seqlens, "cache_seqlens", batch, k_cache);
  std::vector<int64_t> row(batch);
  for (int64_t b = 0; b < batch; ++b) row[b] = b;
  if (cache_batch_idx.has_value()) {
    TORCH_CHECK(!paged, "attention_ext: cache_batch_idx cannot be combined with a paged cache");
    row = read_per_entry(*cache_batch_idx, "cache_batch_idx", batch, k_cache);
  }
  const int64_t slots = k_cache.size(1);
  std::vector<int64_t> table;  // host copy, (batch, per_entry)
  int64_t per_entry = 0;
  if (paged) {
    const at::Tensor host = read_block_table(*block_table, batch, k_cache);
    table.assign(host.data_ptr<int32_t>(), host.data_ptr<int32_t>() + host.numel());
    per_entry = host.size(1);
  }
  // Element offset of (entry b, position pos) in the caches' first two dims; checked first.
  std::vector<int64_t> k_offset(batch * fresh), v_offset(batch * fresh);
  const int64_t capacity = paged ? per_entry * slots : slots;
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(start[b] >= 0 && start[b] + fresh <= capacity, "attention_ext: cache_seqlens[", b, "] = ", start[b],
                " plus ", fresh, " new keys overflows the cache's ", capacity, " positions");
    TORCH_CHECK(paged || (row[b] >= 0 && row[b] < k_cache.size(0)), "attention_ext: cache row ", row[b],
                " of entry ", b, " is outside the cache's ", k_cache.size(0), " rows");
    for (int64_t t = 0; t < fresh; ++t) {
      const int64_t pos = start[b] + t;
      int64_t first = row[b], second = pos;
      if (paged) {
        first = table[b * per_entry + pos / slots];
        second = pos % slots;
        TORCH_CHECK(first >= 0 && first < k_cache.size(0), "attention_ext: block_table[", b, ", ", pos / slots,
                    "] = ", first, " is outside the cache's ", k_cache.size(0), " blocks");
      }
      k_offset[b * fresh + t] = first * k_cache.stride(0) + second * k_cache.stride(1);
      v_offset[b * fresh + t] = first * v_cache.stride(0) + second * v_cache.stride(1);
    }
  }
  // No two new rows to one slot (an entry's row named twice, a block shared by two entries' new
  // positions, or listed twice in one entry's table): whichever came last would stay.
  std::vector<int64_t> order(batch * fresh);
  std::iota(order.begin(), order.end(), int64_t{0});
  std::sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return k_offset[x] < k_offset[y]; });
  for (size_t i = 1; i < order.size(); ++i) {
    const int64_t x = std::min(order[i - 1], order[i]), y = std::max(order[i - 1], order[i]);
    TORCH_CHECK_VALUE(k_offset[x] != k_offset[y], "attention_ext: entry ", x / fresh, "'s new row ", x % fresh,
                      " and entry ", y / fresh, "'s new row ", y % fresh,
                      " go to one cache slot: each slot takes one new key per call");
  }
  if (batch == 0 || fresh == 0 || heads == 0) return;
  // New rows that are a view of a cache go in as they were passed: copied first.
  const auto own = [&](const at::Tensor& rows) {
    return may_share_memory(rows, k_cache) || may_share_memory(rows, v_cache) ? rows.clone() : rows;
  };
  const at::Tensor k_rows = own(k), v_rows = own(v);
  const int64_t bytes = k_cache.element_size();
  for (const auto& [cache, src, offset] :
       {std::tuple<const at::Tensor&, const at::Tensor&, const std::vector<int64_t>&>{k_cache, k_rows, k_offset},
        {v_cache, v_rows, v_offset}}) {
    if (src.size(3) == 0) continue;  // head dim 0: nothing to copy, and the data pointers may be null
    char* dst = static_cast<char*>(cache.data_ptr());
    const char* from = static_cast<const char*>(src.data_ptr());
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t t = 0; t < fresh; ++t)
        for (int64_t h = 0; h < heads; ++h)
          copy_row(dst + (offset[b * fresh + t] + h * cache.stride(2)) * bytes, cache.stride(3),
                   from + (b * src.stride(0) + t * src.stride(1) + h * src.stride(2)) * bytes, src.stride(3),
                   src.size(3), bytes);
  }
  // As torch's in-place ops: autograd notices a saved cache written since.
  for (const at::Tensor* cache : {&k_cache, &v_cache})
    if (!cache->is_inference()) cache->unsafeGetTensorImpl()->bump_version();
}

}  // namespace attention_ext
