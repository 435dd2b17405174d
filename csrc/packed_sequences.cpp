#include "packed_sequences.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <limits>

namespace attention_ext {
namespace {

// Reads one cu_seqlens tensor to the host after checking what can be checked without its values.
std::vector<int64_t> read_cumulative_lengths(const at::Tensor& cu, const char* name, const at::Tensor& q) {
  TORCH_CHECK(cu.scalar_type() == at::kInt, "attention_ext: ", name, " must be int32, got ", cu.scalar_type());
  TORCH_CHECK(cu.dim() == 1 && cu.numel() >= 1, "attention_ext: ", name,
              " must be 1-D with (sequences + 1) entries, got shape ", cu.sizes());
  TORCH_CHECK(cu.device().is_cpu() || cu.device() == q.device(), "attention_ext: ", name, " must be on ",
              q.device(), " (or the CPU), got ", cu.device());
  // On a GPU this copy waits for the stream: the sequences' sizes decide which kernels run.
  const at::Tensor host = cu.to(at::kCPU, at::kLong).contiguous();
  const int64_t* values = host.data_ptr<int64_t>();
  return std::vector<int64_t>(values, values + host.numel());
}

// Checks cumulative lengths against the packed tensor's rows and the caller's maximum length;
// returns the longest sequence.
void check_cumulative_lengths(const std::vector<int64_t>& cu, const char* name, int64_t total_rows,
                              int64_t max_seqlen, const char* max_name) {
  TORCH_CHECK(cu.front() == 0, "attention_ext: ", name, " must start at 0, got ", cu.front());
  int64_t longest = 0;
  for (size_t s = 0; s + 1 < cu.size(); ++s) {
    TORCH_CHECK(cu[s + 1] >= cu[s], "attention_ext: ", name, " must be non-decreasing, got ", cu[s], " then ",
                cu[s + 1], " at sequence ", s);
    longest = std::max(longest, cu[s + 1] - cu[s]);
  }
  TORCH_CHECK(cu.back() <= total_rows, "attention_ext: ", name, " ends at ", cu.back(), " but the packed tensor has ",
              total_rows, " rows");
  TORCH_CHECK(longest <= max_seqlen, "attention_ext: ", max_name, " is ", max_seqlen, " but ", name,
              " holds a sequence of ", longest);
}

// Moves a view to row `rows` of its tensor.
void advance_rows(TensorRef& t, int64_t rows, int64_t element_bytes) {
  advance_elements(t, rows * t.row_stride, element_bytes);
}

}  // namespace

PackedCall check_packed_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                               int64_t max_seqlen_q, int64_t max_seqlen_k, double scale,
                               const LogitOptions& logit, double dropout_p,
                               const std::optional<at::Tensor>& rng_state) {
  PackedCall call;
  call.logit = logit;
  TORCH_CHECK(logit.causal != 1, "attention_ext: packed sequences align causal masks and windows bottom-right ",
              "per sequence (causal = 2); top-left causal (1) is not supported for them");
  call.cu_q = read_cumulative_lengths(cu_seqlens_q, "cu_seqlens_q", q);
  call.cu_k = read_cumulative_lengths(cu_seqlens_k, "cu_seqlens_k", q);
  TORCH_CHECK(call.cu_q.size() == call.cu_k.size(), "attention_ext: cu_seqlens_q and cu_seqlens_k must have the ",
              "same number of entries (sequences + 1), got ", call.cu_q.size(), " and ", call.cu_k.size());
  // ALiBi slopes with one dim more than the batch dims have one row of slopes per sequence.
  const int64_t batch_dims = std::max({q.dim(), k.dim(), v.dim()}) - 2;
  if (logit.alibi_slopes.has_value() && logit.alibi_slopes->dim() == batch_dims + 1 && batch_dims >= 0) {
    const at::Tensor& slopes = *logit.alibi_slopes;
    TORCH_CHECK(slopes.size(0) == call.sequences() || slopes.size(0) == 1, "attention_ext: per-sequence ",
                "alibi_slopes of shape ", slopes.sizes(), " must have one row per sequence (", call.sequences(), ")");
    call.slopes_sequence_stride = slopes.size(0) == 1 ? 0 : slopes.stride(0);
    if (slopes.size(0) == 0)
      call.logit.alibi_slopes.reset();  // no sequences: nothing reads them
    else
      call.logit.alibi_slopes = slopes.select(0, 0);
  }
  call.shape = check_attention_inputs(q, k, v, std::nullopt, scale, call.logit, dropout_p, rng_state);
  TORCH_CHECK(max_seqlen_q >= 0 && max_seqlen_k >= 0, "attention_ext: max_seqlen_q and max_seqlen_k must be >= 0, ",
              "got ", max_seqlen_q, " and ", max_seqlen_k);
  check_cumulative_lengths(call.cu_q, "cu_seqlens_q", call.shape.n, max_seqlen_q, "max_seqlen_q");
  check_cumulative_lengths(call.cu_k, "cu_seqlens_k", call.shape.m, max_seqlen_k, "max_seqlen_k");
  return call;
}

std::pair<at::Tensor, at::Tensor> allocate_packed_forward_outputs(const PackedCall& call, const at::Tensor& q) {
  const std::vector<int64_t>& batch = call.shape.batch;
  const int64_t nd = static_cast<int64_t>(batch.size());
  std::vector<int64_t> rows_first{call.shape.n};
  rows_first.insert(rows_first.end(), batch.begin(), batch.end());
  rows_first.push_back(call.shape.dv);
  std::vector<int64_t> to_batch_first;
  for (int64_t d = 1; d <= nd; ++d) to_batch_first.push_back(d);
  to_batch_first.push_back(0);
  to_batch_first.push_back(nd + 1);
  at::Tensor out = at::empty(rows_first, q.options()).permute(to_batch_first);
  at::Tensor lse = at::empty(with_tail(batch, {call.shape.n}), q.options().dtype(lse_dtype(q.scalar_type())));
  const int64_t used = call.cu_q.back(), tail = call.shape.n - used;
  if (tail > 0) {
    out.narrow(-2, used, tail).zero_();
    lse.narrow(-1, used, tail).fill_(-std::numeric_limits<double>::infinity());
  }
  return {out, lse};
}

namespace {

// Zeroes the gradient rows no sequence's kernels write.
void zero_rows_outside_sequences(const PackedCall& call, at::Tensor& grad_q, at::Tensor& grad_k, at::Tensor& grad_v) {
  // Key rows no sequence with queries attends to: after the last sequence, and those of
  // sequences without queries (sequence_params leaves them out).
  const auto zero_rows = [](at::Tensor& t, int64_t begin, int64_t end) {
    if (end > begin && t.numel() > 0) t.narrow(-2, begin, end - begin).zero_();
  };
  zero_rows(grad_q, call.cu_q.back(), call.shape.n);
  for (at::Tensor* g : {&grad_k, &grad_v}) {
    zero_rows(*g, call.cu_k.back(), call.shape.m);
    for (int64_t s = 0; s < call.sequences(); ++s)
      if (call.cu_q[s + 1] == call.cu_q[s]) zero_rows(*g, call.cu_k[s], call.cu_k[s + 1]);
  }
}

}  // namespace

std::vector<AttentionParams> sequence_params(const AttentionParams& packed, const PackedCall& call) {
  const int64_t values = value_bytes(packed.dtype), stats = stat_bytes(packed.dtype);
  std::vector<AttentionParams> sequences;
  for (int64_t s = 0; s < call.sequences(); ++s) {
    const int64_t q_begin = call.cu_q[s], k_begin = call.cu_k[s];
    if (call.cu_q[s + 1] == q_begin) continue;
    AttentionParams p = packed;
    p.n = call.cu_q[s + 1] - q_begin;
    p.m = call.cu_k[s + 1] - k_begin;
    for (TensorRef* t : {&p.q, &p.out, &p.grad_out, &p.grad_q}) advance_rows(*t, q_begin, values);
    for (TensorRef* t : {&p.lse, &p.grad_lse, &p.delta, &p.shift_hi, &p.shift_lo})
      advance_rows(*t, q_begin, stats);
    for (TensorRef* t : {&p.k, &p.v, &p.grad_k, &p.grad_v}) advance_rows(*t, k_begin, values);
    advance_elements(p.alibi_slopes, s * call.slopes_sequence_stride, sizeof(float));
    p.dropout_row_base = q_begin;
    sequences.push_back(p);
  }
  return sequences;
}

PackedForward prepare_packed_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                     int64_t max_seqlen_q, int64_t max_seqlen_k, double scale,
                                     const LogitOptions& logit, double dropout_p,
                                     const std::optional<at::Tensor>& rng_state) {
  const PackedCall call = check_packed_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                              scale, logit, dropout_p, rng_state);
  PackedForward forward;
  std::tie(forward.out, forward.lse) = allocate_packed_forward_outputs(call, q);
  if (forward.lse.numel() == 0) return forward;
  AttentionParams packed = make_params(call.shape, q, k, v, std::nullopt, scale, call.logit, dropout_p, rng_state);
  packed.out = make_ref(forward.out, call.shape.batch);
  packed.lse = make_row_ref(forward.lse, call.shape.batch);
  forward.sequences = sequence_params(packed, call);
  return forward;
}

PackedBackward prepare_packed_backward(const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse,
                                       const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                       int64_t max_seqlen_q, int64_t max_seqlen_k, const at::Tensor& out,
                                       const at::Tensor& lse, double scale, const LogitOptions& logit,
                                       double dropout_p, const std::optional<at::Tensor>& rng_state) {
  const PackedCall call = check_packed_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                              scale, logit, dropout_p, rng_state);
  PackedBackward result;
  result.backward = prepare_backward(grad_out, grad_lse, q, k, v, std::nullopt, out, lse, scale, call.logit,
                                     dropout_p, rng_state, false);
  if (result.backward.no_rows) return result;
  zero_rows_outside_sequences(call, result.backward.grad_q, result.backward.grad_k, result.backward.grad_v);
  result.sequences = sequence_params(result.backward.params, call);
  return result;
}

}  // namespace attention_ext
