// Backward kernels (delta, dK/dV, dQ, mask gradient) for float storage (SIMT path; see simt_common.cuh).
#include "simt_backward.cuh"

namespace attention_ext {
namespace cuda {

cudaError_t backward_fp32(const AttentionParams& p, const BackwardPlan& plan, cudaStream_t stream) {
  return simt::launch_backward<float>(p, plan, stream);
}

}  // namespace cuda
}  // namespace attention_ext
