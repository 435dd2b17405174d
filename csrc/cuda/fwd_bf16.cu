// Forward and attention-probability kernels for __nv_bfloat16 storage: the tensor-core forward
// (tc_forward.cuh) for head dim 64/128, the generic SIMT path (simt_*.cuh) otherwise.
#include "simt_forward.cuh"
#include "simt_probabilities.cuh"
#include "tc_forward.cuh"

namespace attention_ext {
namespace cuda {

cudaError_t forward_bf16(const AttentionParams& p, cudaStream_t stream) {
  if (tc::eligible(p)) return tc::launch_forward<__nv_bfloat16>(p, stream);
  return simt::launch_forward<__nv_bfloat16>(p, stream);
}

cudaError_t probs_bf16(const AttentionParams& p, cudaStream_t stream) {
  return simt::launch_probs<__nv_bfloat16>(p, stream);
}

}  // namespace cuda
}  // namespace attention_ext
