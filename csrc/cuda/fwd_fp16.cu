// Forward and attention-probability kernels for __half storage: the tensor-core forward
// (tc_forward.cuh) for head dim 64/128, the generic SIMT path (simt_*.cuh) otherwise.
#include "simt_forward.cuh"
#include "simt_probabilities.cuh"
#include "tc_forward.cuh"

namespace attention_ext {
namespace cuda {

cudaError_t forward_fp16(const AttentionParams& p, cudaStream_t stream) {
  if (tc::eligible(p)) return tc::launch_forward<__half>(p, stream);
  return simt::launch_forward<__half>(p, stream);
}

cudaError_t probs_fp16(const AttentionParams& p, cudaStream_t stream) {
  return simt::launch_probs<__half>(p, stream);
}

}  // namespace cuda
}  // namespace attention_ext
