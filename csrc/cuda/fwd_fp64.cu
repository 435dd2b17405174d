// Forward and attention-probability kernels for double storage (generic SIMT path; see simt_common.cuh).
#include "simt_forward.cuh"
#include "simt_probabilities.cuh"

namespace attention_ext {
namespace cuda {

cudaError_t forward_fp64(const AttentionParams& p, cudaStream_t stream) {
  return simt::launch_forward<double>(p, stream);
}

cudaError_t probs_fp64(const AttentionParams& p, cudaStream_t stream) {
  return simt::launch_probs<double>(p, stream);
}

}  // namespace cuda
}  // namespace attention_ext
