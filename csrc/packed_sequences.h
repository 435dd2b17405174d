// Variable-length ("packed") batches, as FlashAttention's varlen functions take them: sequence s
// holds the query rows [cu_seqlens_q[s], cu_seqlens_q[s + 1]) and the key/value rows
// [cu_seqlens_k[s], cu_seqlens_k[s + 1]) of the packed tensors, and sees only its own keys, with
// causal and window aligned per sequence (query i at key i + m_s − n_s).
//
// The kernels need no notion of it. Each sequence is a dense call of its own: the packed call's
// AttentionParams with the sequence's n and m and every pointer moved to the sequence's first row
// (sequence_params). A device binding then runs each kernel pass over all the sequences' work
// items at once (the CPU in one parallel region per pass), so the cost is Σ n_s·m_s and nothing is
// spent on padding; every kernel variant (tiled, decode, fused backward, tensor cores) applies.
//
// The packed ops take the packed tensors with the row dim second to last, like the dense ops:
// q (batch..., total_q, d_k), k/v (batch..., total_k, d), batch dims broadcasting (the heads; GQA
// as a broadcast dim). out comes back as (batch..., total_q, d_v) viewing memory laid out
// (total_q, batch..., d_v), so moving the row dim back to the front is free; lse is
// (batch..., total_q). Rows after the last sequence (cu_seqlens[-1] < total) belong to no
// sequence: output 0, lse −inf, gradient 0.
#pragma once
#include <ATen/core/Tensor.h>  // not ATen/ATen.h, which declares every operator: 4x the parse time

#include <optional>
#include <vector>

#include "op_arguments.h"

namespace attention_ext {

struct PackedCall {
  AttentionShape shape;             // batch dims; n = total_q, m = total_k
  std::vector<int64_t> cu_q, cu_k;  // host copies of the cumulative lengths, sequences + 1 each
  // ALiBi slopes per sequence ((sequences, batch...) slopes): the elements between two sequences'
  // slopes; 0 when the slopes are shared by every sequence.
  int64_t slopes_sequence_stride = 0;
  LogitOptions logit;  // what every sequence's call uses (per-sequence slopes: sequence 0's)

  int64_t sequences() const { return static_cast<int64_t>(cu_q.size()) - 1; }
};

// Checks the packed inputs (the dense rules on the packed tensors, then cu_seqlens: int32, 1-D,
// the same number of sequences, starting at 0, non-decreasing, within the tensors and within
// max_seqlen_q / max_seqlen_k) and reads cu_seqlens to the host.
PackedCall check_packed_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                               int64_t max_seqlen_q, int64_t max_seqlen_k, double scale,
                               const LogitOptions& logit, double dropout_p,
                               const std::optional<at::Tensor>& rng_state);

// out (laid out row-major over (total_q, batch..., d_v)) and lse; rows after the last sequence
// already hold their final values (0 and −inf).
std::pair<at::Tensor, at::Tensor> allocate_packed_forward_outputs(const PackedCall& call, const at::Tensor& q);

// One dense call per sequence with query rows (sequences with none do no work and are left out):
// `packed` describes the packed tensors (n = total_q, m = total_k); each result has the
// sequence's n and m, pointers at its first rows and dropout rows keyed by packed row.
std::vector<AttentionParams> sequence_params(const AttentionParams& packed, const PackedCall& call);

// A packed forward ready for a device's kernels: the checked call, its outputs (rows of no
// sequence already final) and one dense call per sequence writing into them.
struct PackedForward {
  at::Tensor out, lse;
  std::vector<AttentionParams> sequences;
};
PackedForward prepare_packed_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                     int64_t max_seqlen_q, int64_t max_seqlen_k, double scale,
                                     const LogitOptions& logit, double dropout_p,
                                     const std::optional<at::Tensor>& rng_state);

// A packed backward ready for a device's kernels: the gradients, zero where no sequence writes
// (rows after the last sequence, keys of sequences without queries), and one dense call per
// sequence (none when there are no query rows).
struct PackedBackward {
  BackwardCall backward;
  std::vector<AttentionParams> sequences;
};
PackedBackward prepare_packed_backward(const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse,
                                       const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                       int64_t max_seqlen_q, int64_t max_seqlen_k, const at::Tensor& out,
                                       const at::Tensor& lse, double scale, const LogitOptions& logit,
                                       double dropout_p, const std::optional<at::Tensor>& rng_state);

}  // namespace attention_ext
