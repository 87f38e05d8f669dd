"""ctypes binding to the libnccl torch loaded: communicators, symmetric memory, windows, device comms.

Only what device-initiated kernels need is bound. Device communicators go through a small host
shim (kernels/devcomm_shim.cu) compiled against the same NCCL's headers, because the requirements
struct changes layout between releases and must never be hard-coded here.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass, field
from pathlib import Path

from commweave.runtime.compile import compile_host_library
from commweave.runtime.toolchain import find_nccl, nccl_version_string

NCCL_UNIQUE_ID_BYTES = 128
NCCL_WIN_COLL_SYMMETRIC = 0x01
WINDOW_ALIGNMENT = 4096  # NCCL_WIN_REQUIRED_ALIGNMENT
KERNELS_DIR = Path(__file__).parent / "kernels"


class NcclError(RuntimeError):
    """An NCCL call returned an error; the message names the call and NCCL's reason."""


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * NCCL_UNIQUE_ID_BYTES)]


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(find_nccl().library), mode=ctypes.RTLD_GLOBAL)
    vp, sz, i = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
    signatures = {
        "ncclGetVersion": [ctypes.POINTER(i)],
        "ncclGetUniqueId": [ctypes.POINTER(UniqueId)],
        "ncclCommInitRank": [ctypes.POINTER(vp), i, UniqueId, i],
        "ncclCommDestroy": [vp],
        "ncclCommAbort": [vp],
        "ncclCommSplit": [vp, i, i, ctypes.POINTER(vp), vp],
        "ncclMemAlloc": [ctypes.POINTER(vp), sz],
        "ncclMemFree": [vp],
        "ncclCommWindowRegister": [vp, vp, sz, ctypes.POINTER(vp), i],
        "ncclCommWindowDeregister": [vp, vp],
        "ncclGroupStart": [],
        "ncclGroupEnd": [],
    }
    for name, args in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, i
    lib.ncclGetErrorString.argtypes, lib.ncclGetErrorString.restype = [i], ctypes.c_char_p
    lib.ncclGetLastError.argtypes, lib.ncclGetLastError.restype = [vp], ctypes.c_char_p
    return lib


@functools.lru_cache(maxsize=1)
def shim() -> ctypes.CDLL:
    """The device-communicator shim, compiled (cached) against the loaded NCCL's headers."""
    library()  # libnccl must be loaded first so the shim binds to this very copy
    artifact = compile_host_library((KERNELS_DIR / "devcomm_shim.cu").read_text())
    lib = ctypes.CDLL(str(artifact.path))
    vp, i = ctypes.c_void_p, ctypes.c_int
    lib.cw_header_version.restype = i
    lib.cw_devcomm_size.restype = i
    lib.cw_devcomm_create.argtypes, lib.cw_devcomm_create.restype = [vp, i, i, i, i, vp], i
    lib.cw_devcomm_destroy.argtypes, lib.cw_devcomm_destroy.restype = [vp, vp], i
    lib.cw_devcomm_info.argtypes, lib.cw_devcomm_info.restype = [vp, ctypes.POINTER(i)], None
    return lib


def check(result: int, call: str, comm: int | None = None) -> None:
    if result == 0:
        return
    lib = library()
    reason = lib.ncclGetErrorString(result).decode()
    detail = lib.ncclGetLastError(comm).decode() if comm else ""
    raise NcclError(f"{call} failed: {reason} (code {result}){': ' + detail if detail else ''}")


def version() -> int:
    v = ctypes.c_int()
    check(library().ncclGetVersion(ctypes.byref(v)), "ncclGetVersion")
    return v.value


def version_string() -> str:
    return nccl_version_string(version())


def unique_id() -> bytes:
    uid = UniqueId()
    check(library().ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
    return bytes(uid)  # not uid.internal: a c_char array stops at the first NUL


@dataclass
class DevComm:
    """A device communicator: its bytes are passed by value to kernels as `ncclDevComm`."""

    blob: ctypes.Array
    rank: int
    n_ranks: int
    lsa_rank: int
    lsa_size: int
    gin_contexts: int
    lsa_barriers: int
    gin_signals: int

    @property
    def nbytes(self) -> int:
        return ctypes.sizeof(self.blob)


@dataclass
class Window:
    """A symmetric window: `handle` is the `ncclWindow_t` kernels take; `offset` is the byte offset
    of the tensor it was looked up for, from the window's base."""

    handle: int
    base_ptr: int
    nbytes: int
    offset: int = 0


@dataclass
class Communicator:
    """One rank's NCCL communicator (created with ncclCommInitRank on the current CUDA device)."""

    handle: int
    rank: int
    n_ranks: int
    _dev_comms: list[DevComm] = field(default_factory=list)

    @classmethod
    def init_rank(cls, uid: bytes, rank: int, n_ranks: int) -> Communicator:
        if len(uid) != NCCL_UNIQUE_ID_BYTES:
            raise ValueError(f"NCCL unique id must be {NCCL_UNIQUE_ID_BYTES} bytes, got {len(uid)}")
        comm = ctypes.c_void_p()
        check(library().ncclCommInitRank(ctypes.byref(comm), n_ranks, UniqueId.from_buffer_copy(uid), rank), "ncclCommInitRank")
        return cls(comm.value, rank, n_ranks)

    def split(self) -> Communicator:
        """Collective: a new communicator over the same ranks (for probes that may break it)."""
        comm = ctypes.c_void_p()
        check(library().ncclCommSplit(self.handle, 0, self.rank, ctypes.byref(comm), None), "ncclCommSplit", self.handle)
        return Communicator(comm.value, self.rank, self.n_ranks)

    def abort(self) -> None:
        library().ncclCommAbort(self.handle)
        self.handle = 0

    def mem_alloc(self, nbytes: int) -> int:
        ptr = ctypes.c_void_p()
        check(library().ncclMemAlloc(ctypes.byref(ptr), nbytes), f"ncclMemAlloc({nbytes})", self.handle)
        return ptr.value

    def mem_free(self, ptr: int) -> None:
        check(library().ncclMemFree(ptr), "ncclMemFree", self.handle)

    def register_window(self, ptr: int, nbytes: int) -> Window:
        """Collective: every rank registers a buffer of the same size, in the same order."""
        win = ctypes.c_void_p()
        check(
            library().ncclCommWindowRegister(self.handle, ptr, nbytes, ctypes.byref(win), NCCL_WIN_COLL_SYMMETRIC),
            "ncclCommWindowRegister",
            self.handle,
        )
        return Window(win.value, ptr, nbytes)

    def deregister_window(self, window: Window) -> None:
        check(library().ncclCommWindowDeregister(self.handle, window.handle), "ncclCommWindowDeregister", self.handle)

    def create_dev_comm(self, lsa_barriers: int = 0, gin_signals: int = 0, gin_counters: int = 0,
                        gin_force: bool = False) -> DevComm:
        """Collective: every rank creates one with the same requirements."""
        s = shim()
        blob = (ctypes.c_byte * s.cw_devcomm_size())()
        check(s.cw_devcomm_create(self.handle, lsa_barriers, gin_signals, gin_counters, int(gin_force), blob),
              "ncclDevCommCreate", self.handle)
        info = (ctypes.c_int * 5)()
        s.cw_devcomm_info(blob, info)
        dc = DevComm(blob, info[0], info[1], info[2], info[3], info[4], lsa_barriers, gin_signals)
        self._dev_comms.append(dc)
        return dc

    def destroy_dev_comm(self, dev_comm: DevComm) -> None:
        check(shim().cw_devcomm_destroy(self.handle, dev_comm.blob), "ncclDevCommDestroy", self.handle)
        self._dev_comms.remove(dev_comm)

    def destroy(self) -> None:
        for dc in list(self._dev_comms):
            self.destroy_dev_comm(dc)
        check(library().ncclCommDestroy(self.handle), "ncclCommDestroy")
        self.handle = 0
