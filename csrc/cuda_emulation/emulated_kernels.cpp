// The CUDA kernels (SIMT and tensor-core) compiled by the host compiler for the emulation in emulation.h: built only
// by ATTENTION_EXT_CUDA_EMULATION=1 (see setup.py), which registers the CUDA binding for CPU
// tensors so the test suite exercises these kernels without a GPU.
#ifdef ATTN_CUDA_EMULATION
#include "emulation.h"

#include "../cuda/dispatch.cu"
#include "../cuda/fwd_fp64.cu"
#include "../cuda/fwd_fp32.cu"
#include "../cuda/fwd_fp16.cu"
#include "../cuda/fwd_bf16.cu"
#include "../cuda/bwd_fp64.cu"
#include "../cuda/bwd_fp32.cu"
#include "../cuda/bwd_fp16.cu"
#include "../cuda/bwd_bf16.cu"

// The runtime calls the launchers make, answered by the emulation (no CUDA runtime is linked).
extern "C" {
cudaError_t CUDARTAPI cudaGetLastError(void) { return cudaSuccess; }
// One emulated device: an H100/H200 (compute capability 9.0, 132 SMs), so sm_80+ paths and the
// split-KV plan behave as there.
cudaError_t CUDARTAPI cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
cudaError_t CUDARTAPI cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (device != 0) return cudaErrorInvalidDevice;
  if (attr == cudaDevAttrComputeCapabilityMajor) *value = 9;
  else if (attr == cudaDevAttrMultiProcessorCount) *value = 132;
  else if (attr == cudaDevAttrComputeCapabilityMinor) *value = 0;
  else return cudaErrorInvalidValue;
  return cudaSuccess;
}
// Every emulated kernel is "compiled" for that device.
cudaError_t CUDARTAPI cudaFuncGetAttributes(cudaFuncAttributes* attributes, const void*) {
  *attributes = cudaFuncAttributes{};
  attributes->ptxVersion = 90;
  attributes->binaryVersion = 90;
  return cudaSuccess;
}
const char* CUDARTAPI cudaGetErrorString(cudaError_t) { return "cuda emulation error"; }
}
#endif
