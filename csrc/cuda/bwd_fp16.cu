// Backward kernels for __half storage: the tensor-core dK/dV and dQ passes (tc_backward.cuh) for
// head dim 64/128, the SIMT passes (simt_backward.cuh) otherwise; row shift, delta and the mask gradient
// are SIMT kernels on both paths.
#include "simt_backward.cuh"
#include "tc_backward.cuh"

namespace attention_ext {
namespace cuda {

cudaError_t backward_fp16(const AttentionParams& p, const BackwardPlan& plan, cudaStream_t stream) {
  if (tc::backward_eligible(p)) return tc::launch_backward<__half>(p, plan, stream);
  return simt::launch_backward<__half>(p, plan, stream);
}

}  // namespace cuda
}  // namespace attention_ext
