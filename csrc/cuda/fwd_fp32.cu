// Forward and attention-probability kernels for float storage (generic SIMT path; see simt_common.cuh).
#include "simt_forward.cuh"
#include "simt_probabilities.cuh"

namespace attention_ext {
namespace cuda {

cudaError_t forward_fp32(const AttentionParams& p, cudaStream_t stream) {
  return simt::launch_forward<float>(p, stream);
}

cudaError_t probs_fp32(const AttentionParams& p, cudaStream_t stream) {
  return simt::launch_probs<float>(p, stream);
}

}  // namespace cuda
}  // namespace attention_ext
