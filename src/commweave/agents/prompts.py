"""The fast path's prompts: the rewrite (stages A and B) and the judge.

A rewrite prompt holds the task of its stage, the workload (what the harness checks), the static
analysis of the input program, the runtime API a program may use, the directive set (stage B),
the program to start from, and the previous attempt with its failure and the judge's diagnosis.
Each call is one self-contained user message: attempts do not share a conversation, so a prompt
says everything the model needs. The judge's prompt asks for a diagnosis only, never for API calls
or code: the fix is the rewriter's, from a correct understanding of what went wrong.
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass

import torch

from commweave.agents.analysis import ProgramAnalysis
from commweave.space import DirectiveSet
from commweave.contracts.workload import Workload

MAX_ERROR_CHARS = 3000  # of a failure's message and traceback in a prompt

RESPONSE_FORMAT = (
    "Answer with the whole program in one fenced ```python block (the complete module, not a diff), "
    "after at most a few sentences on what you changed. Keep the `# EVOLVE-BLOCK-START` / "
    "`# EVOLVE-BLOCK-END` markers around setup, run and CUDA_SRC."
)

REWRITE_SYSTEM = (
    "You are an expert in multi-GPU programming: CUDA C++, NCCL (host collectives and its device API for "
    "symmetric memory), and PyTorch distributed. You convert host-driven programs, whose communication the CPU "
    "issues, into device-initiated programs, whose GPUs move the data themselves, without changing what the "
    "program computes. Every program you write is compiled and run by a harness that checks it on several shapes "
    "with fresh random inputs. " + RESPONSE_FORMAT
)

JUDGE_SYSTEM = (
    "You review one failed attempt of a program rewrite for multi-GPU communication. From the failure "
    "class, the harness's messages and the program, diagnose the most likely root cause: what goes wrong, "
    "where (function and line), and why the observed failure follows from it. Diagnose, do not prescribe: name "
    "no API calls, write no code and no patch; describe the defect and the property a correct program must have "
    "instead. Answer in plain prose, at most 150 words."
)

PROGRAM_FORMAT = """\
## The program format
A program is one Python module; what may change sits between the lines `# EVOLVE-BLOCK-START` and
`# EVOLVE-BLOCK-END` (imports may stay above the block).
- `CUDA_SRC = r\"\"\" ... \"\"\"` (optional; any module-level string constant whose name ends in
  `CUDA_SRC`): CUDA C++ with `extern "C" __global__` kernels, compiled by nvcc (`-arch=sm_90
  -std=c++17`, NCCL's headers on the include path: `#include <nccl_device.h>`). It must be a plain
  string literal: it is compiled before the program runs.
- `setup(ctx, shape) -> state`: collective (every rank calls it with the same shape, in the same
  order): allocate buffers, create device communicators, compile kernels. `shape["M"]` etc.
- `run(ctx, state, inputs, out)`: one call; writes this rank's whole result into `out`. It must not
  modify `inputs`, and all its work must be ordered before the current stream when it returns
  (join side streams back).
- Optional: `teardown(ctx, state)`; `available(ctx) -> str | None` (a reason it cannot run here).

## `ctx`: one rank's runtime handle
- `ctx.rank`, `ctx.world_size`, `ctx.device`, `ctx.is_cuda`; `ctx.group`: torch.distributed's
  default group (NCCL on GPUs) for host collectives.
- `ctx.symmetric(shape, dtype, zero=True) -> tensor`: a tensor in a symmetric window registered on
  every rank (collective: same shapes, same order on every rank). Zeroed, and ranks lined up
  afterwards, unless `zero=False`.
- `ctx.window(tensor) -> Window`: the window holding a symmetric tensor; pass it to a kernel
  parameter of type `ncclWindow_t`, and `window.offset` (the tensor's byte offset in it) as `size_t`.
- `ctx.dev_comm(lsa_barriers=1, gin_signals=0, gin_counters=0) -> DevComm`: a device communicator
  (collective); pass it to a kernel parameter of type `ncclDevComm` (by value). `lsa_barriers` =
  how many CTAs may hold LSA barrier sessions at once (index them by `blockIdx.x`).
  `.lsa_rank`, `.lsa_size`.
- `ctx.compile(source, label) -> module`; `module.kernel("name").launch(grid, block, [args], stream=None)`:
  arguments are tensors (passed as pointers), Windows, DevComms, and Python ints/floats (sized to
  the kernel's parameters, checked); the default stream is torch's current stream.
- `ctx.peer_ptrs(tensor)`: the tensor's address in every rank's window (index = rank);
  `ctx.peer_tensor(tensor, rank)`: that rank's counterpart as a local tensor (a `copy_` into it is a
  copy-engine transfer over NVLink).
- `ctx.stream(name, priority=0)`: a persistent side stream; `ctx.barrier()`: host barrier across
  ranks; `ctx.synchronize()`; `ctx.device_barrier(stream=None)`: a barrier across all ranks' GPUs.
- Never call ncclMemAlloc, ncclCommWindowRegister or ncclDevCommCreate yourself: ctx does.

## NCCL's device API (NCCL 2.28, `<nccl_device.h>`)
- `ncclGetLsaPointer(win, offset, peer)`: a pointer to byte `offset` of window `win` in LSA rank
  `peer`'s memory (`peer` may be this rank); plain loads and stores through it go over NVLink.
  Every rank's window has the same layout, so the same offset names the same element everywhere.
- `dc.lsaRank`, `dc.lsaSize`, `dc.rank`, `dc.nRanks` on an `ncclDevComm dc`.
- A barrier across the GPUs of all ranks, per CTA:
  `ncclLsaBarrierSession<ncclCoopCta> bar{ncclCoopCta(), dc, ncclTeamLsa(dc), dc.lsaBarrier, blockIdx.x};`
  `bar.sync(ncclCoopCta(), cuda::memory_order_acq_rel);` — CTA b meets CTA b of every rank (so the
  device communicator needs `lsa_barriers >= gridDim.x`); with acq_rel, the stores this CTA made
  before the sync are visible to every peer CTA after it, and the peers' to this one. A session may
  sync more than once.
- The host side (allocation, registration, communicator creation) is ctx's; in NCCL 2.28 there is
  no initializer macro for `ncclDevCommRequirements` (ctx handles it).
"""


@dataclass(frozen=True)
class WorkloadFacts:
    """What the harness checks, in words: the workload, its inputs and output, shapes, tolerance."""

    text: str

    @classmethod
    def of(cls, workload: Workload, world_size: int) -> WorkloadFacts:
        doc = type(workload).__doc__ or sys.modules[type(workload).__module__].__doc__ or ""
        shapes = workload.check_shapes(world_size)
        first = shapes[0]
        inputs = workload.make_inputs(first, world_size, 0, 0, torch.device("cpu"))
        out = workload.make_output(first, world_size, 0, torch.device("meta"))
        sizes = {k: v for k, v in first.params.items() if isinstance(v, int)}
        lines = [
            f"## The workload: `{workload.name}` on {world_size} ranks",
            workload.summary,
            "",
            inspect.cleandoc(doc),
            "",
            f"Inputs on rank 0 at shape {first.label} ({sizes}): "
            + ", ".join(f"`{n}` {list(t.shape)} {str(t.dtype).replace('torch.', '')}" for n, t in inputs.items())
            + f"; output `out` {list(out.shape)} {str(out.dtype).replace('torch.', '')}"
            + (" (allocated in a symmetric window on GPUs)" if workload.symmetric_output else "") + ".",
            f"The harness checks every program on the shapes {', '.join(s.label for s in shapes)} (each with "
            "its own setup), several calls per shape on fresh random inputs, `out` poisoned with NaN before every "
            "call, inputs compared with pristine copies afterwards, and a relative Frobenius error against the "
            f"reference of at most {workload.tolerance():g}. A hang is killed and reported as a timeout.",
        ]
        return cls("\n".join(lines) + "\n")


def _clip(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[: limit // 2] + "\n[... cut ...]\n" + text[-limit // 2:]


def numbered(text: str) -> str:
    """The program with line numbers, so a judge can point at lines."""
    return "\n".join(f"{i:4d}| {line}" for i, line in enumerate(text.splitlines(), 1))


@dataclass(frozen=True)
class Feedback:
    """What the next attempt learns from the previous one."""

    attempt: int
    failure: str  # a failure class, "parse_error", "host_collectives" or "llm_error"
    message: str
    program: str | None  # the failed program (None when the answer held none)
    diagnosis: str = ""

    def render(self) -> str:
        lines = [f"## Your previous attempt (attempt {self.attempt}) failed: {self.failure}", "", _clip(self.message), ""]
        if self.diagnosis:
            lines += ["A reviewer diagnosed the failure:", "", self.diagnosis.strip(), ""]
        if self.program is not None:
            lines += ["The failed program:", "", "```python", self.program.rstrip(), "```", ""]
        lines.append("Fix the cause; keep what worked.")
        return "\n".join(lines) + "\n"


STAGE_A_TASK = """\
# Task: fast path, stage A of 2 — add device infrastructure, keep the host collectives

Rewrite the input program below as a program for the workload `{workload}` (format below) that
still does its communication with the host collectives it has now, and that also sets up, in
`setup`, the device infrastructure stage B will need to replace them: symmetric buffers
(`ctx.symmetric`) for the data peers will write to or read from, their windows (`ctx.window`), and a
device communicator (`ctx.dev_comm`) with enough LSA barriers for the CTAs that will communicate.
Where it fits, let the host collectives already use the symmetric buffers (e.g. gather into one),
so stage B only has to replace how the data gets there. Do not replace any collective yet: this
stage must pass the harness exactly as the input does, proving the infrastructure is sound.
"""

STAGE_B_TASK = """\
# Task: fast path, stage B of 2 — replace the host collectives with device-initiated communication

The program below (stage A) passes the harness with host collectives. Replace every host
collective with device-initiated communication: kernels in `CUDA_SRC` that move the data
themselves through NCCL's device API (stores or loads through `ncclGetLsaPointer` into the
symmetric windows stage A set up, synchronised by LSA barriers), launched from `run`. No
torch.distributed call may remain in the program. Implement exactly the conservative strategy of
the directive set below: correctness first, no overlap tricks. The computation may keep using
library kernels (e.g. torch.matmul / cuBLAS).
"""


def rewrite_prompt(stage: str, workload: str, facts: WorkloadFacts, analysis: ProgramAnalysis, start_text: str,
                   start_language: str, directives: DirectiveSet | None, feedback: Feedback | None) -> str:
    """The user message of one rewrite attempt of `stage` ("A" or "B")."""
    task = (STAGE_A_TASK if stage == "A" else STAGE_B_TASK).format(workload=workload)
    what = "input program" if stage == "A" else "stage A program (passes the harness)"
    parts = [task, facts.text, analysis.render_prompt(), PROGRAM_FORMAT]
    if directives is not None:
        parts.append(directives.render_prompt())
    parts.append(f"## The {what}\n\n```{start_language}\n{start_text.rstrip()}\n```\n")
    if feedback is not None:
        parts.append(feedback.render())
    parts.append(RESPONSE_FORMAT + "\n")
    return "\n".join(parts)


def judge_prompt(stage: str, facts: WorkloadFacts, program: str, failure: str, message: str, detail: str) -> str:
    """The user message of a judge call on a failed attempt."""
    goal = ("stage A: the program keeps its host collectives and adds symmetric buffers, windows and a device "
            "communicator" if stage == "A" else
            "stage B: the program replaces its host collectives with device-initiated communication through NCCL's "
            "device API (LSA pointers into symmetric windows, LSA barriers)")
    parts = [
        f"# A failed attempt of the fast path, {goal}", "",
        facts.text,
        f"## How it failed: {failure}", "", _clip(message), "",
    ]
    if detail.strip():
        parts += ["Traceback / compiler output:", "", "```", _clip(detail), "```", ""]
    parts += ["## The program (line numbers added)", "", "```", numbered(program), "```", "",
              "Diagnose the root cause; do not prescribe API calls or write code."]
    return "\n".join(parts) + "\n"
