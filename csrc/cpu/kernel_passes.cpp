#include "kernel_passes.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <initializer_list>
#include <string>

#include "../attention_geometry.h"
#include "cpu_dispatch.h"

namespace attention_ext {
namespace cpu {
namespace {

// The value of a path switch (an environment variable that forces one of the kernels' paths), ""
// when unset; any other value than the allowed ones is an error, never silently the default.
std::string path_switch(const char* name, std::initializer_list<const char*> allowed) {
  const char* env = std::getenv(name);
  if (env == nullptr || *env == '\0') return "";
  for (const char* value : allowed)
    if (std::string(env) == value) return env;
  TORCH_CHECK(false, "attention_ext: ", name, "=", env, " is not a known value; expected one of: ",
              c10::Join(", ", std::vector<std::string>(allowed.begin(), allowed.end())), " (or unset)");
}

// Calls whose whole product work (batch · n · m · (d_k + d_v) multiply-adds) is below this run
// their passes on the calling thread: starting and joining the thread pool (several microseconds
// per pass) costs more than a second core saves on ~10 µs of work. Every work item owns its
// outputs, so the results are bitwise the same either way.
constexpr double kSerialWork = double(int64_t(1) << 18);

double product_work(const AttentionParams& p) {
  return static_cast<double>(p.batch_numel) * static_cast<double>(p.n) * static_cast<double>(p.m) *
         static_cast<double>(p.dk + p.dv + 1);
}

using Calls = std::vector<const AttentionParams*>;

// Runs fn over the work items of every call, items_of(call) each, as one range of items.
template <class ItemsOf>
void run_pass(ItemFn fn, const Calls& calls, ItemsOf items_of) {
  std::vector<int64_t> start(calls.size() + 1, 0);
  double work = 0.0;
  for (size_t c = 0; c < calls.size(); ++c) {
    start[c + 1] = start[c] + std::max<int64_t>(0, items_of(*calls[c]));
    work += product_work(*calls[c]);
  }
  const int64_t items = start.back();
  if (items == 0) return;
  const auto body = [&](int64_t begin, int64_t end) {
    size_t c = std::upper_bound(start.begin(), start.end(), begin) - start.begin() - 1;
    for (; begin < end; ++c) {
      const int64_t stop = std::min(end, start[c + 1]);
      if (stop > begin) fn(*calls[c], begin - start[c], stop - start[c]);
      begin = std::max(begin, stop);
    }
  };
  if (work < kSerialWork) {
    body(0, items);
    return;
  }
  // Dynamic chunks, not a static split: item costs differ (causal tiles grow along the rows,
  // packed sequences differ in length), and an even split of the range left one thread with most
  // of the work. Guided: each chunk a 1/(4·threads) share of the items left, so the chunks shrink
  // to single items at the end and the last one to finish is short (fixed chunks of 1/16 of a
  // thread's share left a causal forward's last chunk, its costliest query tiles, running on one
  // thread: 2-3% of the call). Items are independent, so any order gives bitwise the same results.
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    int64_t begin = next.load(std::memory_order_relaxed);
    while (begin < items) {
      const int64_t chunk = std::max<int64_t>(1, (items - begin) / (threads * 4));
      if (!next.compare_exchange_weak(begin, begin + chunk, std::memory_order_relaxed)) continue;  // begin reloaded
      body(begin, std::min(items, begin + chunk));
      begin = next.load(std::memory_order_relaxed);
    }
  });
}

Calls all_of(const std::vector<AttentionParams>& calls) {
  Calls out;
  for (const AttentionParams& p : calls) out.push_back(&p);
  return out;
}

int64_t query_tiles(const AttentionParams& p) { return p.batch_numel * ceil_div(p.n, kBlockM); }

// The fused backward (one pass per key owner) saves recomputing S and dP but parallelises only
// over key owners; the split one parallelises over tiles. Both give bitwise identical results,
// so the choice may follow the thread count and the memory. ATTENTION_EXT_CPU_BACKWARD=fused|split
// forces one.
// Each thread of the fused pass holds dQ of every query its key owner serves: n rows per
// broadcast position (the query heads of a GQA group, the batch entries sharing a K/V), so
// G·n·d accumulators. Past kFusedDqScratchBytes per thread (G = 8, n = 16k, d = 64 in float) the
// split pass runs instead: the fused one would hold that much per thread, and stream it through
// memory once per key tile as well.
constexpr int64_t kFusedDqScratchBytes = int64_t{32} << 20;

// d padded to the widest vector's lanes (16): an upper bound on any variant's padded head dim.
int64_t widest_padded(int64_t d) { return ceil_div(imax(d, 1), 16) * 16; }

bool use_fused_backward(const AttentionParams& p, const std::string& forced) {
  if (owners_of(p, p.grad_q) != p.batch_numel) return false;  // query broadcast: dQ rows shared
  if (p.n == 0 || p.m == 0) return false;
  if (forced == "fused" || forced == "split") return forced == "fused";
  const int64_t key_owners = owners_of(p, p.grad_k);
  const int64_t acc_bytes = p.dtype == ScalarType::kFloat64 ? 8 : 4;
  const int64_t dq_scratch = (p.batch_numel / key_owners) * ceil_div(p.n, kBlockM) * kBlockM * widest_padded(p.dk) *
                             acc_bytes;
  return key_owners >= 2 * static_cast<int64_t>(at::get_num_threads()) && dq_scratch <= kFusedDqScratchBytes;
}

// Key ranges of the decode forward (n <= kDecodeRows). A function of the shape alone, never of
// the thread count, so results are bitwise the same on any number of threads: enough items to
// keep a large pool busy, each range at least kMinSplitKeys keys of one K/V head (K/V heads
// walked in lockstep share the minimum) so that merging stays cheap, and at least kMinRangeKeys
// keys: a range's first rows are not prefetched, and it packs the query rows and leaves partial
// outputs of all its heads. (Without that floor a 2048-token cache of 8 interleaved K/V heads
// was cut into 32 one-tile ranges; on a Zen 3, 8 ranges ran 1.0-1.15x faster in two A/B runs.)
constexpr int64_t kDecodeItems = 64;
constexpr int64_t kMinSplitKeys = 512;
constexpr int64_t kMinRangeKeys = 256;

// The ranges cover only the keys some row can see (a sliding window's few, of a long cache).
void set_decode_splits(AttentionParams& p) {
  p.split_key_begin = visible_key_tile_begin(p, 0, kBlockN);
  const int64_t keys = imax(1, visible_key_end(p, 0, p.n) - p.split_key_begin);
  const DecodeGrouping grouping = decode_grouping(p);
  const int64_t head_groups = p.batch_numel / grouping.heads();
  int64_t splits = 1;
  if (head_groups < kDecodeItems)
    splits = imax(1, imin(imin(ceil_div(kDecodeItems, head_groups), keys * grouping.lockstep / kMinSplitKeys),
                          keys / kMinRangeKeys));
  p.split_keys = ceil_div(ceil_div(keys, splits), kBlockN) * kBlockN;
  p.kv_splits = ceil_div(keys, p.split_keys);
}

}  // namespace

// ATTENTION_EXT_CPU_FORWARD=tiled|decode forces one (decode only applies up to kDecodeRows rows).
void run_forward(std::vector<AttentionParams>& calls, const at::Tensor& like) {
  const KernelTable& kernels = active_kernels();
  const bool allow_decode = path_switch("ATTENTION_EXT_CPU_FORWARD", {"tiled", "decode"}) != "tiled";
  Calls tiled, decode;
  std::vector<AttentionParams*> split;  // decode calls over several key ranges: scratch, then a merge
  int64_t scratch_rows = 0;
  for (AttentionParams& p : calls) {
    // Only the decode kernel reads a paged K/V (the bindings copy the blocks of longer calls).
    TORCH_CHECK(p.key_blocks == nullptr || p.n <= kDecodeRows, "attention_ext: internal: a paged call of ", p.n,
                " query rows reached the CPU forward");
    if (p.key_blocks == nullptr && (!allow_decode || p.n > kDecodeRows)) {
      tiled.push_back(&p);
      continue;
    }
    set_decode_splits(p);
    decode.push_back(&p);
    if (p.kv_splits > 1) {
      split.push_back(&p);
      scratch_rows += p.batch_numel * p.kv_splits * p.n;
    }
  }
  run_pass(kernels.forward, tiled, query_tiles);
  if (decode.empty()) return;
  at::Tensor split_out, split_stats;
  if (!split.empty()) {
    const auto acc = like.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    const int64_t acc_bytes = acc == at::kDouble ? 8 : 4;
    int64_t dv = 0;
    for (const AttentionParams* p : split) dv = std::max(dv, p->dv);
    split_out = at::empty({scratch_rows * dv}, like.options().dtype(acc));
    split_stats = at::empty({scratch_rows * 2}, like.options().dtype(acc));
    int64_t rows = 0;
    for (AttentionParams* p : split) {
      p->split_out = static_cast<char*>(split_out.data_ptr()) + rows * dv * acc_bytes;
      p->split_stats = static_cast<char*>(split_stats.data_ptr()) + rows * 2 * acc_bytes;
      rows += p->batch_numel * p->kv_splits * p->n;
    }
  }
  run_pass(kernels.forward_decode, decode,
           [](const AttentionParams& p) { return p.batch_numel / decode_grouping(p).heads() * p.kv_splits; });
  run_pass(kernels.forward_combine, Calls(split.begin(), split.end()),
           [](const AttentionParams& p) { return p.batch_numel; });
}

namespace {

// Whether a call takes the decode backward (backward_decode.inc): a few query rows, as the decode
// forward's, the query not broadcast (each dQ row belongs to one key owner), no mask gradient (its
// pass reads the tiled passes' row statistics), and the query positions of one key owner (their
// Q, dO and dQ rows, held per item) within kFusedDqScratchBytes. A function of the shape, never
// of the thread count: the two backwards round differently.
bool use_decode_backward(const AttentionParams& p, const std::string& forced, const BackwardOutputs& outputs) {
  if (p.n == 0 || p.n > kDecodeRows || p.m == 0 || outputs.mask || p.key_blocks != nullptr) return false;
  if (owners_of(p, p.grad_q) != p.batch_numel) return false;
  if (!forced.empty() && forced != "decode") return false;
  const int64_t acc_bytes = p.dtype == ScalarType::kFloat64 ? 8 : 4;
  const int64_t positions = p.batch_numel / owners_of(p, p.grad_k);
  const int64_t row_bytes = (2 * widest_padded(p.dk) + widest_padded(p.dv)) * acc_bytes;  // (Q, dQ and dO rows)
  const int64_t held = positions * ceil_div(p.n, 4) * 4 * row_bytes;
  return held <= kFusedDqScratchBytes;
}

// Key ranges of the decode backward: as the decode forward's (set_decode_splits), enough items to
// keep a large pool busy, each at least kMinSplitKeys keys; over all keys [0, m), every range
// writing dK and dV of its own (zeros outside the rows' visible keys). A function of the shape.
void set_decode_backward_splits(AttentionParams& p) {
  const int64_t owners = owners_of(p, p.grad_k);
  int64_t splits = 1;
  if (owners < kDecodeItems) splits = imax(1, imin(ceil_div(kDecodeItems, owners), p.m / kMinSplitKeys));
  p.split_key_begin = 0;
  p.split_keys = ceil_div(ceil_div(p.m, splits), kBlockN) * kBlockN;
  p.kv_splits = ceil_div(p.m, p.split_keys);
}

// The decode backward of `calls`: row statistics, the gradients over key ranges, and the sum of
// the ranges' partial dQ where a call has several.
void run_decode_backward(const KernelTable& kernels, std::vector<AttentionParams>& calls) {
  // A call's partial dQ: n rows per (batch index, key range), each at most widest_padded(d_k) wide.
  const auto partial_dq_elements = [](const AttentionParams& p) {
    return p.kv_splits > 1 ? p.batch_numel * p.kv_splits * p.n * widest_padded(p.dk) : 0;
  };
  int64_t scratch = 0;
  bool any_double = false;
  for (AttentionParams& p : calls) {
    set_decode_backward_splits(p);
    scratch += partial_dq_elements(p);
    any_double |= p.dtype == ScalarType::kFloat64;
  }
  at::Tensor partial_dq;
  if (scratch > 0) {
    // (one tensor for all calls, of doubles where some call is fp64: each call's slots are sized
    // in that tensor's elements)
    partial_dq = at::empty({scratch}, at::TensorOptions().dtype(any_double ? at::kDouble : at::kFloat));
    char* base = static_cast<char*>(partial_dq.data_ptr());
    for (AttentionParams& p : calls) {
      if (p.kv_splits == 1) continue;
      p.split_out = base;
      base += partial_dq_elements(p) * partial_dq.element_size();
    }
  }
  const Calls all = all_of(calls);
  Calls split;
  for (const AttentionParams* p : all)
    if (p->kv_splits > 1) split.push_back(p);
  run_pass(kernels.decode_backward_rows, all, [](const AttentionParams& p) { return owners_of(p, p.grad_k); });
  run_pass(kernels.decode_backward, all,
           [](const AttentionParams& p) { return owners_of(p, p.grad_k) * p.kv_splits; });
  run_pass(kernels.decode_backward_combine, split, [](const AttentionParams& p) { return p.batch_numel; });
}

}  // namespace

// ATTENTION_EXT_CPU_BACKWARD=fused|split|decode forces one (decode only applies where
// use_decode_backward allows it; fused and split are the tiled backward's two schedules).
void run_backward(const std::vector<AttentionParams>& calls, const BackwardOutputs& outputs) {
  const KernelTable& kernels = active_kernels();
  const std::string forced = path_switch("ATTENTION_EXT_CPU_BACKWARD", {"fused", "split", "decode"});
  std::vector<AttentionParams> decode_calls;
  Calls all;
  for (const AttentionParams& p : calls) {
    if (use_decode_backward(p, forced, outputs))
      decode_calls.push_back(p);
    else
      all.push_back(&p);
  }
  if (!decode_calls.empty()) run_decode_backward(kernels, decode_calls);
  if (all.empty()) return;
  run_pass(kernels.row_shift, all, query_tiles);
  run_pass(kernels.backward_delta, all, query_tiles);
  Calls fused, split;
  for (const AttentionParams* p : all) (use_fused_backward(*p, forced) ? fused : split).push_back(p);
  run_pass(kernels.backward_fused, fused, [](const AttentionParams& p) { return owners_of(p, p.grad_k); });
  if (outputs.kv)
    run_pass(kernels.backward_kv, split,
             [](const AttentionParams& p) { return owners_of(p, p.grad_k) * ceil_div(p.m, kBlockN); });
  if (outputs.q)
    run_pass(kernels.backward_q, split,
             [](const AttentionParams& p) { return owners_of(p, p.grad_q) * ceil_div(p.n, kBlockM); });
  if (outputs.mask)
    run_pass(kernels.backward_mask, all, [](const AttentionParams& p) {
      const bool rows_bcast = p.n > 1 && p.grad_mask.row_stride == 0;
      return owners_of(p, p.grad_mask) * (rows_bcast ? 1 : ceil_div(p.n, kBlockM));
    });
}

void run_probabilities(const std::vector<AttentionParams>& calls) {
  const Calls all = all_of(calls);
  run_pass(active_kernels().row_shift, all, query_tiles);
  run_pass(active_kernels().probabilities, all, query_tiles);
}

}  // namespace cpu
}  // namespace attention_ext
