// The ops' arguments, shared by the CPU and CUDA bindings: the argument checks and the translation
// of tensors into AttentionParams. Every check names the tensor, what it got and what was
// expected, because the ops are public (torch.ops.attention_ext.*) as well as used by Python.
#pragma once
#include <ATen/core/Tensor.h>  // not ATen/ATen.h, which declares every operator: 4x the parse time

#include <optional>
#include <string>
#include <vector>

#include "attention_params.h"

namespace attention_ext {

// How a call forms its logits beyond scale·q·k, as the ops take it: which keys each query may
// see by position (the causal code: 0 none, 1 top-left, 2 bottom-right; the sliding window's
// (left, right), −1 = unbounded), the score modifiers (softcap, 0 = none; ALiBi slopes, float32,
// broadcasting to the batch dims) and the sinks.
struct LogitOptions {
  int64_t causal = 0;
  int64_t window_left = -1;
  int64_t window_right = -1;
  double softcap = 0.0;
  std::optional<at::Tensor> alibi_slopes;
  std::optional<at::Tensor> sinks;  // one logit per batch position, in the lse's dtype
};

// The float dtypes the kernels take: float64, float32, float16 and bfloat16.
bool supported_dtype(at::ScalarType t);

// The largest window bound: the kernels add bounds to int64 positions (_arguments.MAX_WINDOW).
constexpr int64_t kMaxWindow = int64_t{1} << 62;

// The default softmax scale: 1/sqrt(head_dim), and 1 when head_dim is 0 (every score is 0 then).
double default_scale(int64_t head_dim);

// The validated shape of one call.
struct AttentionShape {
  std::vector<int64_t> batch;  // broadcast batch shape of q, k, v (and the mask)
  int64_t n = 0, m = 0, dk = 0, dv = 0;
};

// Checks q/k/v (and mask, if given) and returns the broadcast shape.
AttentionShape check_attention_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const std::optional<at::Tensor>& attn_mask, double scale,
                                      const LogitOptions& logit, double dropout_p,
                                      const std::optional<at::Tensor>& rng_state);

// Fills sizes, dtype, q/k/v/mask views, scale, causal, window, softcap, ALiBi slopes, sinks and
// dropout fields.
AttentionParams make_params(const AttentionShape& shape, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, const std::optional<at::Tensor>& attn_mask,
                            double scale, const LogitOptions& logit, double dropout_p,
                            const std::optional<at::Tensor>& rng_state);

// View of a (batch_tail..., rows, cols) tensor broadcast to `batch`: stride 0 on missing or size-1
// batch dims, and on a size-1 row or column dim (so it broadcasts to any length).
TensorRef make_ref(const at::Tensor& t, const std::vector<int64_t>& batch);
// View of a (batch_tail..., rows) tensor such as lse: rows use row_stride.
TensorRef make_row_ref(const at::Tensor& t, const std::vector<int64_t>& batch);
// The same for rows (batch..., n) stored contiguously at data (as make_row_ref of such a tensor).
TensorRef contiguous_row_ref(void* data, const std::vector<int64_t>& batch, int64_t n);

// The order in memory, outermost first, of out's dims (batch..., n, d_v): the dims the query has
// (size > 1, stride not 0) in the query's order, read from its strides, largest first (ties kept in
// order); the dims it broadcasts (missing, size 1, stride 0) where they are; d_v innermost. So a
// query seen through a transpose of (batch, n, heads, d) memory, as model code and FlashAttention's
// layout give it (also split into (kv_heads, groups) for GQA), gets an out whose transpose back to
// (batch, n, heads, d_v) is contiguous and whose reshape to (batch, n, heads * d_v) is free, as
// with torch's fused kernels (which return that memory order for any query); a contiguous query, a
// contiguous out. The fake kernel (attention_ext/_ops.py) states the same rule.
std::vector<int64_t> out_dim_order(const at::Tensor& q, int64_t out_dims);

// Forward outputs: out (batch..., n, d_v) in the query's dtype laid out by out_dim_order, and
// lse (batch..., n) contiguous in lse_dtype.
std::pair<at::Tensor, at::Tensor> allocate_forward_outputs(const AttentionShape& shape, const at::Tensor& q);

// attention_probs runs the forward with a value of no columns (so it computes only the lse).
at::Tensor empty_value_for(const at::Tensor& key);

// The row-shift scratch (AttentionParams::shift_hi / shift_lo): two tensors shaped like lse,
// attached to p. The caller keeps them alive while p is in use.
std::pair<at::Tensor, at::Tensor> attach_row_shift(AttentionParams& p, const at::Tensor& lse,
                                                   const AttentionShape& shape);

// Checks dropout_keep_mask's arguments and allocates its (batch..., n, m) bool result on
// rng_state's device; *batch_numel receives the product of batch_shape.
at::Tensor allocate_keep_mask(const at::Tensor& rng_state, at::IntArrayRef batch_shape, int64_t n,
                              int64_t m, double dropout_p, int64_t* batch_numel);

// One backward call, ready for the device's kernels: the extra inputs checked (shapes, dtypes,
// same device as the query), the gradients allocated with the inputs' own shapes (grad_mask
// zero-filled, or empty (0,) when not requested), the scratch rows (delta, shift_hi, shift_lo)
// allocated, and params pointing at all of it. When there are no query rows (`no_rows`), the
// gradients are already final (zeros) and no kernel needs to run. Device-specific state (a
// device guard) must be set up by the caller before this allocates.
struct BackwardCall {
  AttentionShape shape;
  AttentionParams params;
  at::Tensor grad_q, grad_k, grad_v, grad_mask;
  bool no_rows = false;
  // Kept alive for the kernels: the gradient they read (a caller may hand in a temporary),
  // converted grad_lse, scratch rows, 2-D view of grad_mask.
  // (row_stats: delta, shift_hi and shift_lo, each lse's shape, one after the other.)
  at::Tensor grad_out, grad_lse_acc, row_stats, grad_mask_2d;
};

BackwardCall prepare_backward(const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse,
                              const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const std::optional<at::Tensor>& attn_mask, const at::Tensor& out,
                              const at::Tensor& lse, double scale, const LogitOptions& logit, double dropout_p,
                              const std::optional<at::Tensor>& rng_state, bool mask_requires_grad);

std::vector<int64_t> with_tail(std::vector<int64_t> batch, std::initializer_list<int64_t> tail);

ScalarType to_scalar_type(at::ScalarType t);

// Bytes per element of a call's values (q, k, v, out, gradients) and of its row statistics (lse,
// delta, row shifts), and a view moved by `elements` of them (an absent view stays absent): how
// the packed and KV-cache calls point each sequence's dense call at its rows.
int64_t value_bytes(ScalarType t);
int64_t stat_bytes(ScalarType t);
void advance_elements(TensorRef& t, int64_t elements, int64_t element_bytes);
at::ScalarType lse_dtype(at::ScalarType t);

}  // namespace attention_ext
