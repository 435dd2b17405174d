// CPU implementations of the attention ops: validation -> AttentionParams -> kernel variant,
// run over work items with at::parallel_for (torch's OpenMP pool, so torch.set_num_threads
// applies). Work items are independent, so results do not depend on the thread count.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdlib>
#include <initializer_list>
#include <string>
#include <vector>

#include "../op_arguments.h"
#include "../attention_geometry.h"
#include "../philox.h"
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
constexpr int64_t kSerialWork = int64_t(1) << 18;

bool is_small_call(const AttentionParams& p) {
  const double work = static_cast<double>(p.batch_numel) * static_cast<double>(p.n) * static_cast<double>(p.m) *
                      static_cast<double>(p.dk + p.dv + 1);
  return work < static_cast<double>(kSerialWork);
}

void run_items(ItemFn fn, const AttentionParams& p, int64_t items) {
  if (items <= 0) return;
  if (is_small_call(p)) {
    fn(p, 0, items);
    return;
  }
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) { fn(p, begin, end); });
}

// The fused backward (one pass per key owner) saves recomputing S and dP but parallelises only
// over key owners; the split one parallelises over tiles. Both give bitwise identical results,
// so the choice may follow the thread count. ATTENTION_EXT_CPU_BACKWARD=fused|split forces one.
bool use_fused_backward(const AttentionParams& p, int64_t k_owners) {
  const std::string forced = path_switch("ATTENTION_EXT_CPU_BACKWARD", {"fused", "split"});
  if (owners_of(p, p.grad_q) != p.batch_numel) return false;  // query broadcast: dQ rows shared
  if (p.n == 0 || p.m == 0) return false;
  if (!forced.empty()) return forced == "fused";
  return k_owners >= 2 * static_cast<int64_t>(at::get_num_threads());
}

// Key ranges of the decode forward (n <= kDecodeRows). A function of the shape alone, never of
// the thread count, so results are bitwise the same on any number of threads: enough items to
// keep a large pool busy, each range at least kMinSplitKeys keys so that merging stays cheap.
constexpr int64_t kDecodeItems = 64;
constexpr int64_t kMinSplitKeys = 512;

// The ranges cover only the keys some row can see (a sliding window's few, of a long cache).
void set_decode_splits(AttentionParams& p) {
  p.split_key_begin = visible_key_tile_begin(p, 0, kBlockN);
  const int64_t keys = imax(1, visible_key_end(p, 0, p.n) - p.split_key_begin);
  int64_t splits = 1;
  if (p.batch_numel < kDecodeItems)
    splits = imax(1, imin(ceil_div(kDecodeItems, p.batch_numel), keys / kMinSplitKeys));
  p.split_keys = ceil_div(ceil_div(keys, splits), kBlockN) * kBlockN;
  p.kv_splits = ceil_div(keys, p.split_keys);
}

// The tiled forward, or for few query rows the decode forward (+ merge of its key ranges).
// ATTENTION_EXT_CPU_FORWARD=tiled|decode forces one (decode only applies up to kDecodeRows rows).
void run_forward(AttentionParams& p, const at::Tensor& q) {
  const KernelTable& kernels = active_kernels();
  const bool decode = p.n <= kDecodeRows && path_switch("ATTENTION_EXT_CPU_FORWARD", {"tiled", "decode"}) != "tiled";
  if (!decode) {
    run_items(kernels.forward, p, p.batch_numel * ceil_div(p.n, kBlockM));
    return;
  }
  set_decode_splits(p);
  if (p.kv_splits == 1) {
    run_items(kernels.forward_decode, p, p.batch_numel);
    return;
  }
  const auto acc = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor split_out =
      at::empty({p.batch_numel * p.kv_splits * p.n * p.dv}, q.options().dtype(acc));
  const at::Tensor split_stats = at::empty({p.batch_numel * p.kv_splits * p.n * 2}, q.options().dtype(acc));
  p.split_out = split_out.data_ptr();
  p.split_stats = split_stats.data_ptr();
  run_items(kernels.forward_decode, p, p.batch_numel * p.kv_splits);
  run_items(kernels.forward_combine, p, p.batch_numel);
}

std::tuple<at::Tensor, at::Tensor> attention_fwd(const at::Tensor& q, const at::Tensor& k,
                                                 const at::Tensor& v,
                                                 const std::optional<at::Tensor>& attn_mask,
                                                 double scale, int64_t causal, int64_t window_left,
                                                 int64_t window_right, double softcap,
                                                 const std::optional<at::Tensor>& alibi_slopes,
                                                 const std::optional<at::Tensor>& sinks, double dropout_p,
                                                 const std::optional<at::Tensor>& rng_state) {
  const LogitOptions logit{causal, window_left, window_right, softcap, alibi_slopes, sinks};
  const AttentionShape shape =
      check_attention_inputs(q, k, v, attn_mask, scale, logit, dropout_p, rng_state);
  auto [out, lse] = allocate_forward_outputs(shape, q);
  if (lse.numel() == 0) return {out, lse};
  AttentionParams p = make_params(shape, q, k, v, attn_mask, scale, logit, dropout_p, rng_state);
  p.out = make_ref(out, shape.batch);
  p.lse = make_row_ref(lse, shape.batch);
  run_forward(p, q);
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_bwd(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse, const at::Tensor& q,
    const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& attn_mask,
    const at::Tensor& out, const at::Tensor& lse, double scale, int64_t causal, int64_t window_left,
    int64_t window_right, double softcap, const std::optional<at::Tensor>& alibi_slopes,
                                                 const std::optional<at::Tensor>& sinks, double dropout_p,
    const std::optional<at::Tensor>& rng_state, bool mask_requires_grad) {
  const LogitOptions logit{causal, window_left, window_right, softcap, alibi_slopes, sinks};
  BackwardCall call = prepare_backward(grad_out, grad_lse, q, k, v, attn_mask, out, lse, scale,
                                       logit, dropout_p, rng_state, mask_requires_grad);
  at::Tensor &gq = call.grad_q, &gk = call.grad_k, &gv = call.grad_v, &gmask = call.grad_mask;
  if (call.no_rows) return {gq, gk, gv, gmask};
  const AttentionShape& shape = call.shape;
  const AttentionParams& p = call.params;

  const KernelTable& kernels = active_kernels();
  const int64_t q_tiles = ceil_div(shape.n, kBlockM);
  run_items(kernels.row_shift, p, p.batch_numel * q_tiles);
  run_items(kernels.backward_delta, p, p.batch_numel * q_tiles);
  const int64_t k_owners = owners_of(p, p.grad_k);
  if (use_fused_backward(p, k_owners)) {
    run_items(kernels.backward_fused, p, k_owners);
  } else {
    if (gk.numel() > 0 || gv.numel() > 0)
      run_items(kernels.backward_kv, p, k_owners * ceil_div(shape.m, kBlockN));
    if (gq.numel() > 0) run_items(kernels.backward_q, p, owners_of(p, p.grad_q) * q_tiles);
  }
  if (mask_requires_grad && gmask.numel() > 0) {
    const bool rows_bcast = shape.n > 1 && p.grad_mask.row_stride == 0;
    run_items(kernels.backward_mask, p, owners_of(p, p.grad_mask) * (rows_bcast ? 1 : q_tiles));
  }
  return {gq, gk, gv, gmask};
}

at::Tensor attention_probs(const at::Tensor& q, const at::Tensor& k,
                           const std::optional<at::Tensor>& attn_mask, double scale, int64_t causal,
                           int64_t window_left, int64_t window_right, double softcap,
                           const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks) {
  const LogitOptions logit{causal, window_left, window_right, softcap, alibi_slopes, sinks};
  // A value tensor with no columns: the forward kernel then computes only the lse.
  const at::Tensor v = empty_value_for(k);
  const AttentionShape shape = check_attention_inputs(q, k, v, attn_mask, scale, logit, 0.0, {});
  const auto lse_pair = attention_fwd(q, k, v, attn_mask, scale, causal, window_left, window_right, softcap,
                                      alibi_slopes, sinks, 0.0, {});
  at::Tensor probs = at::empty(with_tail(shape.batch, {shape.n, shape.m}), q.options());
  if (probs.numel() == 0) return probs;
  AttentionParams p = make_params(shape, q, k, v, attn_mask, scale, logit, 0.0, {});
  const at::Tensor& lse = std::get<1>(lse_pair);
  p.lse = make_row_ref(lse, shape.batch);
  const auto row_shift = attach_row_shift(p, lse, shape);
  p.probs = make_ref(probs, shape.batch);
  const int64_t items = p.batch_numel * ceil_div(shape.n, kBlockM);
  run_items(active_kernels().row_shift, p, items);
  run_items(active_kernels().probabilities, p, items);
  return probs;
}

at::Tensor dropout_keep_mask(const at::Tensor& rng_state, at::IntArrayRef batch_shape, int64_t n,
                             int64_t m, double dropout_p) {
  int64_t batch = 1;
  at::Tensor keep = allocate_keep_mask(rng_state, batch_shape, n, m, dropout_p, &batch);
  const at::Tensor state = rng_state.contiguous();
  const uint64_t seed = static_cast<uint64_t>(state.data_ptr<int64_t>()[0]);
  const uint64_t offset = static_cast<uint64_t>(state.data_ptr<int64_t>()[1]);
  const uint32_t threshold = dropout_threshold(dropout_p);
  bool* data = keep.data_ptr<bool>();
  at::parallel_for(0, batch * n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / n, i = row % n;
      for (int64_t j = 0; j < m; j += 4) {
        const PhiloxWords w = dropout_words(seed, offset, static_cast<uint64_t>(b),
                                            static_cast<uint64_t>(i), static_cast<uint64_t>(j));
        for (int t = 0; t < 4 && j + t < m; ++t) data[row * m + j + t] = w.w[t] >= threshold;
      }
    }
  });
  return keep;
}

}  // namespace

#ifndef ATTN_CUDA_EMULATION  // there the CUDA binding takes CPU tensors (cuda_emulation/emulation.h)
TORCH_LIBRARY_IMPL(attention_ext, CPU, m) {
  m.impl("attention_fwd", &attention_fwd);
  m.impl("attention_bwd", &attention_bwd);
  m.impl("attention_probs", &attention_probs);
  m.impl("dropout_keep_mask", &dropout_keep_mask);
}
#endif

}  // namespace cpu
}  // namespace attention_ext
