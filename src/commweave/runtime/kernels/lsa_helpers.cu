// Kernels the runtime itself needs: peer addresses of a window, and a device-side barrier
// that lines all ranks up before a timed iteration.
#include <nccl_device.h>
#include <cstdint>

extern "C" __global__ void cw_peer_pointers(ncclWindow_t win, size_t offset, int nPeers, uint64_t* out) {
  int p = threadIdx.x;
  if (p < nPeers) out[p] = (uint64_t)ncclGetLsaPointer(win, offset, p);
}

extern "C" __global__ void cw_lsa_barrier(ncclDevComm dc) {
  ncclLsaBarrierSession<ncclCoopCta> bar{ncclCoopCta(), dc, ncclTeamLsa(dc), dc.lsaBarrier, blockIdx.x};
  bar.sync(ncclCoopCta(), cuda::memory_order_acq_rel);
}
