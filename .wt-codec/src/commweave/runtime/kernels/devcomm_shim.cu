// Host shim: creates and destroys NCCL device communicators.
// Compiled by nvcc against the headers of the very NCCL that is loaded, because the layout of
// ncclDevCommRequirements differs between releases (2.28 has no initializer macro; 2.29+ does).
#include <nccl.h>
#include <nccl_device.h>
#include <cstring>

extern "C" int cw_header_version() { return NCCL_VERSION_CODE; }
extern "C" int cw_devcomm_size() { return (int)sizeof(ncclDevComm); }

extern "C" int cw_devcomm_create(ncclComm_t comm, int lsaBarrierCount, int ginSignalCount,
                                 int ginCounterCount, int ginForceEnable, void* out) {
#ifdef NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER
  ncclDevCommRequirements reqs = NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER;
#else
  ncclDevCommRequirements reqs;
  memset(&reqs, 0, sizeof reqs);
#endif
  reqs.lsaBarrierCount = lsaBarrierCount;
  reqs.ginSignalCount = ginSignalCount;
  reqs.ginCounterCount = ginCounterCount;
  reqs.ginForceEnable = ginForceEnable != 0;
  return (int)ncclDevCommCreate(comm, &reqs, (ncclDevComm*)out);
}

extern "C" int cw_devcomm_destroy(ncclComm_t comm, const void* devComm) {
  return (int)ncclDevCommDestroy(comm, (const ncclDevComm*)devComm);
}

// Fields the host wants to read back: {rank, nRanks, lsaRank, lsaSize, ginContextCount}.
extern "C" void cw_devcomm_info(const void* devComm, int* out5) {
  const ncclDevComm* d = (const ncclDevComm*)devComm;
  out5[0] = d->rank;
  out5[1] = d->nRanks;
  out5[2] = d->lsaRank;
  out5[3] = d->lsaSize;
  out5[4] = (int)d->ginContextCount;
}
