#include "op_arguments.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <limits>
#include <numeric>
#include <algorithm>
#include <sstream>

#include "attention_geometry.h"
#include "philox.h"

namespace attention_ext {
namespace {

std::string shape_str(at::IntArrayRef s) {
  std::ostringstream os;
  os << "(";
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << (s.size() == 1 ? ",)" : ")");
  return os.str();
}

void check_float_tensor(const at::Tensor& t, const char* name) {
  TORCH_CHECK(supported_dtype(t.scalar_type()), "attention_ext: ", name,
              " must be a floating tensor (float64, float32, float16 or bfloat16), got ",
              t.scalar_type());
  TORCH_CHECK(t.dim() >= 2, "attention_ext: ", name,
              " must have at least 2 dims (..., length, head_dim), got shape ", shape_str(t.sizes()));
}

}  // namespace

bool supported_dtype(at::ScalarType t) {
  return t == at::kDouble || t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

double default_scale(int64_t head_dim) { return head_dim > 0 ? 1.0 / std::sqrt(static_cast<double>(head_dim)) : 1.0; }

std::vector<int64_t> with_tail(std::vector<int64_t> batch, std::initializer_list<int64_t> tail) {
  batch.insert(batch.end(), tail.begin(), tail.end());
  return batch;
}

ScalarType to_scalar_type(at::ScalarType t) {
  switch (t) {
    case at::kDouble:
      return ScalarType::kFloat64;
    case at::kFloat:
      return ScalarType::kFloat32;
    case at::kHalf:
      return ScalarType::kFloat16;
    case at::kBFloat16:
      return ScalarType::kBFloat16;
    default:
      TORCH_CHECK(false, "attention_ext: unsupported dtype ", t);
  }
}

int64_t value_bytes(ScalarType t) {
  return t == ScalarType::kFloat64 ? 8 : t == ScalarType::kFloat32 ? 4 : 2;
}

int64_t stat_bytes(ScalarType t) { return t == ScalarType::kFloat64 ? 8 : 4; }

void advance_elements(TensorRef& t, int64_t elements, int64_t element_bytes) {
  if (t.data != nullptr) t.data = static_cast<char*>(t.data) + elements * element_bytes;
}

at::ScalarType lse_dtype(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

AttentionShape check_attention_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const std::optional<at::Tensor>& attn_mask, double scale,
                                      const LogitOptions& logit, double dropout_p,
                                      const std::optional<at::Tensor>& rng_state) {
  check_float_tensor(q, "query");
  check_float_tensor(k, "key");
  check_float_tensor(v, "value");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "attention_ext: query, key and value must have the same dtype, got query ",
              q.scalar_type(), ", key ", k.scalar_type(), ", value ", v.scalar_type());
  TORCH_CHECK(k.device() == q.device() && v.device() == q.device(),
              "attention_ext: query, key and value must be on the same device, got query ",
              q.device(), ", key ", k.device(), ", value ", v.device());
  TORCH_CHECK(q.size(-1) == k.size(-1), "attention_ext: query and key must have the same head dim ",
              "(last dim), got query ", shape_str(q.sizes()), " and key ", shape_str(k.sizes()));
  TORCH_CHECK(k.size(-2) == v.size(-2), "attention_ext: key and value must have the same length ",
              "(dim -2), got key ", shape_str(k.sizes()), " and value ", shape_str(v.sizes()));
  TORCH_CHECK(std::isfinite(scale), "attention_ext: scale must be a finite number, got ", scale);
  {
    // The kernels hold scale·log2(e) in the accumulation dtype (float32 unless the inputs are
    // float64): beyond its range every score would become inf or NaN.
    const double acc_max = q.scalar_type() == at::kDouble ? std::numeric_limits<double>::max()
                                                          : std::numeric_limits<float>::max();
    TORCH_CHECK(std::fabs(scale) * kLog2e <= acc_max, "attention_ext: scale ", scale,
                " overflows the ", lse_dtype(q.scalar_type()), " accumulation of ", q.scalar_type(),
                " inputs (|scale| must be at most ", acc_max / kLog2e, ")");
  }
  TORCH_CHECK(logit.causal >= 0 && logit.causal <= 2,
              "attention_ext: causal must be 0 (none), 1 (top-left) or 2 (bottom-right), got ", logit.causal);
  TORCH_CHECK(logit.window_left >= -1 && logit.window_right >= -1,
              "attention_ext: window bounds must be >= 0, or -1 for unbounded, got (", logit.window_left,
              ", ", logit.window_right, ")");
  TORCH_CHECK(logit.window_left <= kMaxWindow && logit.window_right <= kMaxWindow,
              "attention_ext: window bounds must be at most 2**62 (they are added to int64 positions), got (",
              logit.window_left, ", ", logit.window_right, ")");
  TORCH_CHECK(std::isfinite(logit.softcap) && logit.softcap >= 0.0,
              "attention_ext: softcap must be a finite number >= 0 (0: none), got ", logit.softcap);
  {
    // The kernels hold softcap·log2(e) and its reciprocal in the accumulation dtype: beyond its
    // range the cap would be inf (NaN scores), below its normal range 0 (silently none).
    const bool is_double = q.scalar_type() == at::kDouble;
    const double acc_max = is_double ? std::numeric_limits<double>::max() : std::numeric_limits<float>::max();
    const double acc_tiny = is_double ? std::numeric_limits<double>::min() : std::numeric_limits<float>::min();
    const double cap = logit.softcap * kLog2e, top = std::min(acc_max, 1.0 / acc_tiny);
    TORCH_CHECK(logit.softcap == 0.0 || (cap >= acc_tiny && cap <= top), "attention_ext: softcap ", logit.softcap,
                " is outside the ", lse_dtype(q.scalar_type()), " accumulation of ", q.scalar_type(), " inputs (",
                acc_tiny / kLog2e, " <= softcap <= ", top / kLog2e, ", or 0 for none)");
  }
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0,
              "attention_ext: dropout_p must be in [0, 1), got ", dropout_p);
  if (dropout_p > 0.0) {
    TORCH_CHECK(rng_state.has_value(), "attention_ext: dropout_p > 0 needs an rng_state tensor");
    TORCH_CHECK(rng_state->scalar_type() == at::kLong && rng_state->numel() == 2,
                "attention_ext: rng_state must be an int64 tensor of 2 elements (seed, offset), got ",
                rng_state->scalar_type(), " of shape ", shape_str(rng_state->sizes()));
    TORCH_CHECK(rng_state->device() == q.device(), "attention_ext: rng_state must be on ",
                q.device(), ", got ", rng_state->device());
  }

  // Broadcast the batch dims (all but the last two) of q, k and v.
  AttentionShape shape;
  shape.n = q.size(-2);
  shape.m = k.size(-2);
  shape.dk = q.size(-1);
  shape.dv = v.size(-1);
  // A window is aligned bottom-right (query i sits at key i + m − n); top-left causal aligns at
  // key i. The two agree only when n == m.
  TORCH_CHECK(logit.causal != 1 || (logit.window_left < 0 && logit.window_right < 0) || shape.n == shape.m,
              "attention_ext: a sliding window is aligned bottom-right and cannot be combined with ",
              "top-left causal when queries (", shape.n, ") and keys (", shape.m,
              ") differ in number; use bottom-right causal");
  const int64_t nd = std::max({q.dim(), k.dim(), v.dim()}) - 2;
  shape.batch.assign(nd, 1);
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{q, "query"},
                                {k, "key"},
                                {v, "value"}}) {
    const int64_t tnd = t.dim() - 2;
    for (int64_t i = 0; i < tnd; ++i) {
      const int64_t d = nd - tnd + i;
      const int64_t s = t.size(i);
      if (s == 1) continue;
      TORCH_CHECK(shape.batch[d] == 1 || shape.batch[d] == s,
                  "attention_ext: the batch dims of query ", shape_str(q.sizes()), ", key ",
                  shape_str(k.sizes()), " and value ", shape_str(v.sizes()),
                  " do not broadcast (", name, " has size ", s, " at batch dim ", d, ")");
      shape.batch[d] = s;
    }
  }
  TORCH_CHECK(nd <= kMaxBatchDims, "attention_ext: at most ", kMaxBatchDims,
              " batch dims are supported, got ", nd, " (reshape the leading dims together)");
  // The backward kernel owns dK and dV per key position, so key and value must broadcast alike.
  {
    std::vector<int64_t> kb(nd, 1), vb(nd, 1);
    for (int64_t i = 0; i < k.dim() - 2; ++i) kb[nd - (k.dim() - 2) + i] = k.size(i);
    for (int64_t i = 0; i < v.dim() - 2; ++i) vb[nd - (v.dim() - 2) + i] = v.size(i);
    TORCH_CHECK(kb == vb, "attention_ext: key and value must have the same batch dims at the op ",
                "level, got key ", shape_str(k.sizes()), " and value ", shape_str(v.sizes()),
                " (attention_ext.scaled_dot_product_attention broadcasts them for you)");
  }

  if (attn_mask.has_value()) {
    const at::Tensor& mask = *attn_mask;
    TORCH_CHECK(mask.device() == q.device(), "attention_ext: attn_mask must be on ", q.device(),
                ", got ", mask.device());
    TORCH_CHECK(mask.scalar_type() == at::kBool || mask.scalar_type() == q.scalar_type(),
                "attention_ext: attn_mask must be bool or have the query's dtype (", q.scalar_type(),
                "), got ", mask.scalar_type());
    const auto target = with_tail(shape.batch, {shape.n, shape.m});
    bool ok = mask.dim() <= static_cast<int64_t>(target.size());
    for (int64_t i = 0; ok && i < mask.dim(); ++i) {
      const int64_t s = mask.size(mask.dim() - 1 - i);
      const int64_t want = target[target.size() - 1 - i];
      ok = s == 1 || s == want;
    }
    TORCH_CHECK(ok, "attention_ext: attn_mask of shape ", shape_str(mask.sizes()),
                " does not broadcast to the attention weights' shape ", shape_str(target));
  }
  // One value per batch position (per head): ALiBi slopes (float32) and sinks (the lse's dtype).
  for (const auto& [values, name, dtype] :
       {std::tuple<const std::optional<at::Tensor>&, const char*, at::ScalarType>{logit.alibi_slopes, "alibi_slopes",
                                                                                    at::kFloat},
        {logit.sinks, "sinks", lse_dtype(q.scalar_type())}}) {
    if (!values.has_value()) continue;
    const at::Tensor& t = *values;
    TORCH_CHECK(t.scalar_type() == dtype, "attention_ext: ", name, " must be ", dtype, " for ", q.scalar_type(),
                " inputs, got ", t.scalar_type());
    TORCH_CHECK(t.device() == q.device(), "attention_ext: ", name, " must be on ", q.device(), ", got ", t.device());
    bool ok = t.dim() <= nd;
    for (int64_t i = 0; ok && i < t.dim(); ++i) {
      const int64_t s = t.size(t.dim() - 1 - i);
      ok = s == 1 || s == shape.batch[nd - 1 - i];
    }
    TORCH_CHECK(ok, "attention_ext: ", name, " of shape ", shape_str(t.sizes()), " does not broadcast to the batch dims ",
                shape_str(shape.batch), " (one value per head: (heads,) or (batch, heads) for (batch, heads, n, d) inputs)");
  }
  return shape;
}

namespace {

// A view of t whose last `tail_dims` dims are per-row / per-column and the rest batch dims,
// aligned to the right of `batch`: stride 0 on missing and size-1 batch dims.
TensorRef batch_view(const at::Tensor& t, const std::vector<int64_t>& batch, int64_t tail_dims) {
  TensorRef r;
  r.data = t.data_ptr();
  const int64_t nd = static_cast<int64_t>(batch.size());
  const int64_t tnd = t.dim() - tail_dims;
  for (int64_t i = 0; i < tnd; ++i) r.batch_stride[nd - tnd + i] = t.size(i) == 1 ? 0 : t.stride(i);
  return r;
}

}  // namespace

TensorRef make_ref(const at::Tensor& t, const std::vector<int64_t>& batch) {
  TensorRef r = batch_view(t, batch, 2);
  r.row_stride = t.size(-2) == 1 ? 0 : t.stride(-2);
  r.col_stride = t.size(-1) == 1 ? 0 : t.stride(-1);
  return r;
}

TensorRef make_row_ref(const at::Tensor& t, const std::vector<int64_t>& batch) {
  TensorRef r = batch_view(t, batch, 1);
  r.row_stride = t.size(-1) == 1 ? 0 : t.stride(-1);
  return r;
}

TensorRef contiguous_row_ref(void* data, const std::vector<int64_t>& batch, int64_t n) {
  TensorRef r;
  r.data = data;
  int64_t stride = n;
  for (int64_t i = static_cast<int64_t>(batch.size()) - 1; i >= 0; --i) {
    r.batch_stride[i] = batch[i] == 1 ? 0 : stride;
    stride *= batch[i];
  }
  r.row_stride = n == 1 ? 0 : 1;
  return r;
}

AttentionParams make_params(const AttentionShape& shape, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, const std::optional<at::Tensor>& attn_mask,
                            double scale, const LogitOptions& logit, double dropout_p,
                            const std::optional<at::Tensor>& rng_state) {
  AttentionParams p;
  p.dtype = to_scalar_type(q.scalar_type());
  p.batch_ndim = static_cast<int32_t>(shape.batch.size());
  p.batch_numel = 1;
  for (size_t d = 0; d < shape.batch.size(); ++d) {
    p.batch_size[d] = shape.batch[d];
    p.batch_numel *= shape.batch[d];
  }
  p.n = shape.n;
  p.m = shape.m;
  p.dk = shape.dk;
  p.dv = shape.dv;
  p.q = make_ref(q, shape.batch);
  p.k = make_ref(k, shape.batch);
  p.v = make_ref(v, shape.batch);
  if (attn_mask.has_value()) {
    const at::Tensor& mask = *attn_mask;
    // A mask of fewer than 2 dims is (m,) or a scalar: view it as (1, m) / (1, 1).
    at::Tensor m2 = mask;
    while (m2.dim() < 2) m2 = m2.unsqueeze(0);
    p.mask = make_ref(m2, shape.batch);
    p.mask_kind = mask.scalar_type() == at::kBool ? MaskKind::kBool : MaskKind::kAdditive;
  }
  p.scale = scale;
  p.causal = static_cast<CausalKind>(logit.causal);
  p.window_left = logit.window_left;
  p.window_right = logit.window_right;
  p.softcap = logit.softcap;
  if (logit.alibi_slopes.has_value()) p.alibi_slopes = batch_view(*logit.alibi_slopes, shape.batch, 0);
  if (logit.sinks.has_value()) p.sinks = batch_view(*logit.sinks, shape.batch, 0);
  p.dropout_p = dropout_p;
  p.dropout_threshold = dropout_threshold(dropout_p);
  if (dropout_p > 0.0) {
    TORCH_CHECK(rng_state->is_contiguous(), "attention_ext: rng_state must be contiguous");
    if (rng_state->is_cpu()) {
      p.seed = static_cast<uint64_t>(rng_state->data_ptr<int64_t>()[0]);
      p.offset = static_cast<uint64_t>(rng_state->data_ptr<int64_t>()[1]);
    } else {
      p.rng_state_device = rng_state->data_ptr<int64_t>();
    }
  }
  return p;
}

std::pair<at::Tensor, at::Tensor> attach_row_shift(AttentionParams& p, const at::Tensor& lse,
                                                   const AttentionShape& shape) {
  at::Tensor hi = at::empty(lse.sizes(), lse.options()), lo = at::empty(lse.sizes(), lse.options());
  p.shift_hi = make_row_ref(hi, shape.batch);
  p.shift_lo = make_row_ref(lo, shape.batch);
  return {hi, lo};
}

BackwardCall prepare_backward(const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse,
                              const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const std::optional<at::Tensor>& attn_mask, const at::Tensor& out,
                              const at::Tensor& lse, double scale, const LogitOptions& logit, double dropout_p,
                              const std::optional<at::Tensor>& rng_state, bool mask_requires_grad) {
  BackwardCall call;
  call.shape = check_attention_inputs(q, k, v, attn_mask, scale, logit, dropout_p, rng_state);
  const AttentionShape& shape = call.shape;
  const auto out_shape = with_tail(shape.batch, {shape.n, shape.dv});
  const auto lse_shape = with_tail(shape.batch, {shape.n});
  TORCH_CHECK(grad_out.sizes() == at::IntArrayRef(out_shape) && grad_out.scalar_type() == q.scalar_type(),
              "attention_ext: grad_out must have shape ", at::IntArrayRef(out_shape), " and dtype ",
              q.scalar_type(), ", got ", grad_out.sizes(), " ", grad_out.scalar_type());
  TORCH_CHECK(out.sizes() == at::IntArrayRef(out_shape) && out.scalar_type() == q.scalar_type(),
              "attention_ext: out must have shape ", at::IntArrayRef(out_shape), " and dtype ",
              q.scalar_type(), ", got ", out.sizes(), " ", out.scalar_type());
  const at::ScalarType stat_dtype = lse_dtype(q.scalar_type());
  TORCH_CHECK(lse.sizes() == at::IntArrayRef(lse_shape) && lse.scalar_type() == stat_dtype,
              "attention_ext: lse must have shape ", at::IntArrayRef(lse_shape), " and dtype ",
              stat_dtype, ", got ", lse.sizes(), " ", lse.scalar_type());
  if (grad_lse.has_value())
    TORCH_CHECK(grad_lse->sizes() == at::IntArrayRef(lse_shape) && grad_lse->is_floating_point(),
                "attention_ext: grad_lse must be a floating tensor of shape ", at::IntArrayRef(lse_shape), ", got ",
                grad_lse->sizes(), " ", grad_lse->scalar_type());
  for (const auto& [t, name] : {std::pair<const at::Tensor*, const char*>{&grad_out, "grad_out"},
                                {&out, "out"},
                                {&lse, "lse"},
                                {grad_lse.has_value() ? &*grad_lse : nullptr, "grad_lse"}})
    if (t != nullptr)
      TORCH_CHECK(t->device() == q.device(), "attention_ext: ", name, " must be on ", q.device(),
                  " like the query, got ", t->device());
  TORCH_CHECK(!mask_requires_grad || (attn_mask.has_value() && attn_mask->is_floating_point()),
              "attention_ext: a mask gradient needs a floating attn_mask");

  // Each gradient in its input's layout (empty_like's rule; a dense one for a broadcast input):
  // a (batch, n, heads, d) query seen through a transpose gets a gradient the model's reshape
  // takes without a copy.
  call.grad_q = at::empty_like(q);
  call.grad_k = at::empty_like(k);
  call.grad_v = at::empty_like(v);
  call.grad_mask = mask_requires_grad ? at::zeros(attn_mask->sizes(), attn_mask->options())
                                      : at::empty({0}, q.options());
  if (lse.numel() == 0) {  // no query rows: nothing flows back
    call.grad_q.zero_();
    call.grad_k.zero_();
    call.grad_v.zero_();
    call.no_rows = true;
    return call;
  }

  AttentionParams& p = call.params;
  p = make_params(shape, q, k, v, attn_mask, scale, logit, dropout_p, rng_state);
  p.out = make_ref(out, shape.batch);
  p.lse = make_row_ref(lse, shape.batch);
  call.grad_out = grad_out;
  p.grad_out = make_ref(grad_out, shape.batch);
  if (grad_lse.has_value()) {
    call.grad_lse_acc = grad_lse->to(stat_dtype);
    p.grad_lse = make_row_ref(call.grad_lse_acc, shape.batch);
  }
  // delta and the row shift's two words: three rows of one scratch tensor (one allocation, not
  // three: a small call's backward spent a tenth of its time allocating).
  // (Referred to by hand: views made through the dispatcher cost more than the allocation saved.)
  call.row_stats = at::empty({3 * lse.numel()}, lse.options());
  char* const stats = static_cast<char*>(call.row_stats.data_ptr());
  const int64_t rows_bytes = lse.numel() * static_cast<int64_t>(lse.element_size());
  p.delta = contiguous_row_ref(stats, shape.batch, shape.n);
  p.shift_hi = contiguous_row_ref(stats + rows_bytes, shape.batch, shape.n);
  p.shift_lo = contiguous_row_ref(stats + 2 * rows_bytes, shape.batch, shape.n);
  p.grad_q = make_ref(call.grad_q, shape.batch);
  p.grad_k = make_ref(call.grad_k, shape.batch);
  p.grad_v = make_ref(call.grad_v, shape.batch);
  if (mask_requires_grad) {
    call.grad_mask_2d = call.grad_mask;
    while (call.grad_mask_2d.dim() < 2) call.grad_mask_2d = call.grad_mask_2d.unsqueeze(0);
    p.grad_mask = make_ref(call.grad_mask_2d, shape.batch);
  }
  return call;
}

std::vector<int64_t> out_dim_order(const at::Tensor& q, int64_t out_dims) {
  const int64_t missing = out_dims - q.dim();  // the query's dims align to the right of out's
  std::vector<int64_t> order(out_dims);
  std::iota(order.begin(), order.end(), 0);
  std::vector<int64_t> slots;  // the dims the query has (size > 1, a stride), in out's order
  for (int64_t i = missing; i < out_dims - 1; ++i)
    if (q.size(i - missing) != 1 && q.stride(i - missing) != 0) slots.push_back(i);
  std::vector<int64_t> by_stride = slots;
  std::stable_sort(by_stride.begin(), by_stride.end(),
                   [&](int64_t a, int64_t b) { return q.stride(a - missing) > q.stride(b - missing); });
  for (size_t s = 0; s < slots.size(); ++s) order[slots[s]] = by_stride[s];
  return order;
}

std::pair<at::Tensor, at::Tensor> allocate_forward_outputs(const AttentionShape& shape, const at::Tensor& q) {
  at::Tensor lse = at::empty(with_tail(shape.batch, {shape.n}), q.options().dtype(lse_dtype(q.scalar_type())));
  const std::vector<int64_t> sizes = with_tail(shape.batch, {shape.n, shape.dv});
  const std::vector<int64_t> order = out_dim_order(q, static_cast<int64_t>(sizes.size()));
  if (std::is_sorted(order.begin(), order.end())) return {at::empty(sizes, q.options()), lse};
  std::vector<int64_t> in_memory(sizes.size()), to_out(sizes.size());
  for (size_t i = 0; i < order.size(); ++i) {
    in_memory[i] = sizes[order[i]];
    to_out[order[i]] = static_cast<int64_t>(i);
  }
  return {at::empty(in_memory, q.options()).permute(to_out), lse};
}

at::Tensor empty_value_for(const at::Tensor& key) {
  check_float_tensor(key, "key");  // before key.sizes().back(): a 0-d key has no last dim
  std::vector<int64_t> v_shape(key.sizes().begin(), key.sizes().end());
  v_shape.back() = 0;
  return at::empty(v_shape, key.options());
}

at::Tensor allocate_keep_mask(const at::Tensor& rng_state, at::IntArrayRef batch_shape, int64_t n,
                              int64_t m, double dropout_p, int64_t* batch_numel) {
  TORCH_CHECK(rng_state.scalar_type() == at::kLong && rng_state.numel() == 2,
              "attention_ext: rng_state must be an int64 tensor of 2 elements (seed, offset), got ",
              rng_state.scalar_type(), " of shape ", rng_state.sizes());
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, "attention_ext: dropout_p must be in [0, 1), got ",
              dropout_p);
  TORCH_CHECK(n >= 0 && m >= 0, "attention_ext: n and m must be >= 0, got ", n, " and ", m);
  for (int64_t s : batch_shape)
    TORCH_CHECK(s >= 0, "attention_ext: batch_shape's sizes must be >= 0, got ", batch_shape);
  std::vector<int64_t> shape(batch_shape.begin(), batch_shape.end());
  *batch_numel = 1;
  for (int64_t s : shape) *batch_numel *= s;
  shape.push_back(n);
  shape.push_back(m);
  return at::empty(shape, rng_state.options().dtype(at::kBool));
}

}  // namespace attention_ext
