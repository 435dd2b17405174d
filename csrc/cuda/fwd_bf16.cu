// Forward and attention-probability kernels for __nv_bfloat16 storage: the tensor-core forward
// (tc_forward.cuh) for head dim 64/128, the generic SIMT path (simt.cuh) otherwise.
#include "simt.cuh"
#ifndef ATTN_CUDA_EMULATION  // inline PTX: the host emulation runs the SIMT path only
#include "tc_forward.cuh"
#endif

namespace attention_ext {
namespace cuda {

cudaError_t forward_bf16(const AttentionParams& p, cudaStream_t stream) {
#ifndef ATTN_CUDA_EMULATION
  if (tc::eligible(p)) return tc::launch_forward<__nv_bfloat16>(p, stream);
#endif
  return simt::launch_forward<__nv_bfloat16>(p, stream);
}

cudaError_t probs_bf16(const AttentionParams& p, cudaStream_t stream) {
  return simt::launch_probs<__nv_bfloat16>(p, stream);
}

}  // namespace cuda
}  // namespace attention_ext
