// The order of kernel passes of each CPU op, over a list of dense calls: one call for the dense
// ops, one per sequence for the packed (variable-length) ops (packed_sequences.h). Each pass runs
// the work items of all the calls in one parallel region (torch's OpenMP pool, so
// torch.set_num_threads applies). Work items are independent and write disjoint outputs, so the
// results do not depend on the thread count.
#pragma once
#include <ATen/core/Tensor.h>  // not ATen/ATen.h, which declares every operator: 4x the parse time

#include <vector>

#include "../attention_params.h"

namespace attention_ext {
namespace cpu {

// Writes out and lse: the tiled forward, or for calls of few query rows the decode forward over
// key ranges and the merge of its ranges (scratch allocated like `like`, accumulator type).
void run_forward(std::vector<AttentionParams>& calls, const at::Tensor& like);

struct BackwardOutputs {
  bool kv = true, q = true, mask = false;
};
// Writes the row shifts and delta, then the gradients asked for.
void run_backward(const std::vector<AttentionParams>& calls, const BackwardOutputs& outputs);

// Writes the row shifts, then probs (from a saved lse).
void run_probabilities(const std::vector<AttentionParams>& calls);

}  // namespace cpu
}  // namespace attention_ext
