// Self-test of the device API: a one-shot all-reduce of float32 where every rank reads all peers'
// windows with plain loads (LSA) and writes the sum into its own output.
#include <nccl_device.h>

extern "C" __global__ void cw_lsa_allreduce(ncclWindow_t src, size_t srcOffset, float* out, size_t count,
                                            ncclDevComm dc) {
  ncclLsaBarrierSession<ncclCoopCta> bar{ncclCoopCta(), dc, ncclTeamLsa(dc), dc.lsaBarrier, blockIdx.x};
  bar.sync(ncclCoopCta(), cuda::memory_order_acquire);  // every rank's input is written
  const size_t stride = (size_t)blockDim.x * gridDim.x;
  for (size_t i = threadIdx.x + (size_t)blockIdx.x * blockDim.x; i < count; i += stride) {
    float sum = 0.f;
    for (int p = 0; p < dc.lsaSize; p++) sum += ((const float*)ncclGetLsaPointer(src, srcOffset, p))[i];
    out[i] = sum;
  }
  bar.sync(ncclCoopCta(), cuda::memory_order_release);  // nobody overwrites inputs still being read
}
