// Backward kernels (delta, dK/dV, dQ, mask gradient) for __nv_bfloat16 storage (SIMT path; see simt.cuh).
#include "simt.cuh"

namespace attention_ext {
namespace cuda {

cudaError_t backward_bf16(const AttentionParams& p, const BackwardPlan& plan, cudaStream_t stream) {
  return simt::launch_backward<__nv_bfloat16>(p, plan, stream);
}

}  // namespace cuda
}  // namespace attention_ext
