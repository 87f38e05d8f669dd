"""Jobs that prove the runtime works on a machine: run by `commweave doctor` and the GPU tests."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

from commweave.runtime import nccl
from commweave.runtime.capabilities import rdma_devices
from commweave.runtime.context import RankContext
from commweave.runtime.graphs import CallGraphs
from commweave.runtime.nccl import KERNELS_DIR

LSA_ALLREDUCE_CTAS = 8


def probe(ctx: RankContext) -> dict[str, Any]:
    """What this rank's NCCL offers: version, LSA team, and whether GIN works (and why not)."""
    info: dict[str, Any] = {"rank": ctx.rank, "device": str(ctx.device)}
    if ctx.comm is None:
        return {**info, "lsa": False, "gin": False, "gin_reason": "no CUDA device"}
    info["nccl_loaded"] = nccl.version_string()
    info["nccl_torch"] = ".".join(map(str, torch.cuda.nccl.version()))
    info["gpu"] = torch.cuda.get_device_name(ctx.device)
    dc = ctx.dev_comm(lsa_barriers=1)
    info.update(lsa=dc.lsa_size > 1, lsa_size=dc.lsa_size, n_ranks=dc.n_ranks)
    ctx.end_candidate()
    nics = ", ".join(rdma_devices()) or "none"
    # A failed GIN request leaves a communicator in an error state: ask on a throwaway split.
    trial = ctx.comm.split()
    try:
        gdc = trial.create_dev_comm(lsa_barriers=0, gin_signals=1)
        info["gin"] = gdc.gin_contexts > 0
        info["gin_reason"] = "" if info["gin"] else f"NCCL created no GIN context (RDMA NICs: {nics})"
        trial.destroy()
    except nccl.NcclError as exc:
        info["gin"] = False
        info["gin_reason"] = f"{exc} (RDMA NICs: {nics})"
        trial.abort()
    return info


def lsa_allreduce(ctx: RankContext, count: int, seed: int = 0) -> dict[str, Any]:
    """Sum `count` float32 values across ranks with an LSA kernel and compare with torch's NCCL
    all_reduce of the same inputs. Returns the max abs difference and whether outputs match."""
    src = ctx.symmetric((count,), torch.float32)
    gen = torch.Generator(device=ctx.device).manual_seed(seed * 1000 + ctx.rank)
    src.copy_(torch.randn(count, generator=gen, device=ctx.device))
    expected = src.clone()
    dist.all_reduce(expected)
    out = torch.full((count,), float("nan"), device=ctx.device)
    dc = ctx.dev_comm(lsa_barriers=LSA_ALLREDUCE_CTAS)
    kernel = ctx.compile((KERNELS_DIR / "lsa_allreduce.cu").read_text(), "lsa_allreduce").kernel("cw_lsa_allreduce")
    win = ctx.window(src)
    kernel.launch(LSA_ALLREDUCE_CTAS, 256, [win, win.offset, out, count, dc])
    torch.cuda.synchronize(ctx.device)
    diff = (out - expected).abs().max().item() if count else 0.0
    ctx.end_candidate()
    return {"rank": ctx.rank, "max_abs_diff": diff, "ok": bool(diff <= 1e-5 * max(1.0, ctx.world_size)), "pid": os.getpid()}


def triton_peer_read(ctx: RankContext, count: int = 5000) -> dict[str, Any]:
    """Each rank reads its right neighbour's window with a Triton kernel (via ctx.peer_ptrs)."""
    from commweave.runtime.triton_peer import copy_from_peer

    src = ctx.symmetric((count,), torch.float32)
    src.fill_(float(ctx.rank + 1))
    torch.cuda.synchronize(ctx.device)
    ctx.barrier()  # every window is filled before anyone reads
    peer = (ctx.rank + 1) % ctx.world_size
    out = torch.full((count,), float("nan"), device=ctx.device)
    copy_from_peer(ctx.peer_ptrs(src)[peer], out)
    torch.cuda.synchronize(ctx.device)
    ctx.barrier()  # nobody's window is reused while a peer still reads it
    ok = bool((out == float(peer + 1)).all())
    ctx.end_candidate()
    return {"rank": ctx.rank, "ok": ok}


def call_graphs_replay(ctx: RankContext) -> dict[str, Any]:
    """CallGraphs on a GPU: eager first call, then one capture per address set, replays that
    compute on new data, and the oldest graph evicted past capacity."""
    graphs = CallGraphs(capacity=2)
    sets = [(torch.randn(64, 64, device=ctx.device), torch.empty(64, 64, device=ctx.device)) for _ in range(3)]
    ok = True
    for _ in range(2):
        for x, out in sets:
            x.normal_()
            graphs(lambda x=x, out=out: torch.mm(x, x, out=out), [x, out])
            torch.cuda.synchronize(ctx.device)
            ok &= bool(torch.allclose(out, x @ x, rtol=1e-3, atol=1e-3))
    return {"ok": ok, "kept": len(graphs)}


def hold_stream(ctx: RankContext) -> dict[str, Any]:
    """hold_stream on a GPU: work queued behind the gate waits for release(); without a release,
    the gate lets the stream go after its timeout."""
    x = torch.ones(1 << 20, device=ctx.device)
    x.mul_(1)  # load the kernel now: lazy loading a kernel waits for a running gate to end
    torch.cuda.synchronize(ctx.device)
    release = ctx.hold_stream(timeout_s=5.0)
    x.mul_(2)
    done = torch.cuda.Event()
    done.record()
    time.sleep(0.2)
    held = not done.query()
    release()
    done.synchronize()
    ctx.hold_stream(timeout_s=0.01)  # never released
    x.mul_(2)
    began = time.perf_counter()
    torch.cuda.synchronize(ctx.device)
    waited_s = time.perf_counter() - began
    return {"held": held, "released": bool((x == 4).all()), "timeout_s": waited_s}
