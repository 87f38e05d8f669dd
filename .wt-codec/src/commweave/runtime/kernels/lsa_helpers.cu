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

// Holds a stream until the host has queued what follows it (flag >= expected, the flag in pinned
// host memory), or at most timeout_ns (a program that waits for the GPU inside its call would
// otherwise never let the host release it). A timed region queued behind it starts with its work
// already queued: the timer sees device time, not the host's launch time.
extern "C" __global__ void cw_host_gate(const volatile int* flag, int expected, unsigned long long timeout_ns) {
  unsigned long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (*flag < expected && now - start < timeout_ns);
}
