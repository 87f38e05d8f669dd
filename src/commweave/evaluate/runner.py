"""The program side of the cascade: what runs inside a program process (runtime/candidate.py).

It loads one program and, on the judge's requests, sets it up, runs it on the judge's shared
buffers, and tears it down. Nothing here is trusted: a candidate may patch any of it, and the
judge assumes so (it writes the inputs, poisons and reads the output, times from its own side,
and parses what comes back as data under a schema: runtime/wire.py). Requests are JSON objects
{"op": ..., "args": [...]}: load (text, name) -> reason it cannot run or None; setup (label,
params, symmetric_bytes) -> bytes it holds (GPUs); buffers (go handle, base64) then the block
(shared_buffers) -> the base64 IPC handle of its 'done' event (GPUs); batch (count, settle): calls
on input sets and outputs 0..count-1, timed or not (it is never told); settle: the stream-order
check of the last batch (GPUs); memory -> bytes two calls add at their peak (GPUs); teardown; exit. Answers: {"ok": value} or {"error": {"type", "message", "traceback"}}.
"""

from __future__ import annotations

import traceback
from typing import Any

import torch

from commweave.contracts.context import ProgramContext
from commweave.contracts.poison import poison_
from commweave.contracts.program import load_program, unavailable_reason
from commweave.contracts.workload import Shape
from commweave.runtime.candidate import MESSAGE_CHARS, TRACEBACK_CHARS
from commweave.runtime.pool import is_sticky_cuda_error
from commweave.runtime.shared_buffers import receive_buffers
from commweave.runtime.wire import Channel, decode_bytes, encode_bytes


def held_bytes(ctx: ProgramContext) -> int:
    """Device memory held right now: torch's allocated tensors and the symmetric windows in use."""
    if not ctx.is_cuda:
        return 0
    return torch.cuda.memory_allocated(ctx.device) + ctx.symmetric_bytes_in_use()


#: bytes of each output the stream-order check samples: a late write to more than ~1 % of an output
#: is caught almost surely (0.99 ** 1024 < 1e-4), at a cost independent of the output's size
SAMPLES_PER_OUTPUT = 1024


def sample_offsets(outputs: int, stride: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """Offsets into the outputs' bytes (output i at i * stride, `nbytes` long): SAMPLES_PER_OUTPUT
    per output, drawn at random once, output by output; an output of fewer bytes is sampled whole
    (with repeats)."""
    if nbytes <= SAMPLES_PER_OUTPUT:
        within = torch.arange(SAMPLES_PER_OUTPUT, device=device).remainder(max(1, nbytes)).expand(outputs, -1)
    else:
        within = torch.randint(0, nbytes, (outputs, SAMPLES_PER_OUTPUT), device=device)
    return (within + torch.arange(outputs, device=device).unsqueeze(1) * stride).reshape(-1)


class WorkEscapedStream(RuntimeError):
    """The program's output changed after its current stream's work ended (judged `suspect`)."""


class _Served:
    """One program in this process, and the judge's buffers it runs on."""

    def __init__(self, ctx: ProgramContext):
        self.ctx = ctx
        self.program: Any = None
        self.state: Any = None
        self.inputs: list[dict[str, torch.Tensor]] = []
        self.outs: list[torch.Tensor] = []
        self.out_bytes: torch.Tensor | None = None  # GPUs: every output's bytes, one view of the block
        self.out_stride = 0  # bytes from one output to the next in out_bytes
        self.written = 0  # samples the last batch's stream-order check compares
        self.symmetric: torch.Tensor | None = None  # the output window a symmetric-output workload gets
        self.go: Any = None
        self.done: Any = None
        self.samples: torch.Tensor | None = None  # GPUs: per output, byte offsets into out_bytes the check samples
        self.snapshot: torch.Tensor | None = None  # GPUs: those bytes as the current stream left them
        self._keep: Any = None

    def load(self, text: str, name: str) -> str | None:
        self.program = load_program(text, name)
        return unavailable_reason(self.program, self.ctx)

    def setup(self, shape: Any, symmetric_bytes: int) -> int:
        if symmetric_bytes:  # the harness's output, not counted as the program's memory
            self.symmetric = self.ctx.symmetric((symmetric_bytes,), torch.uint8, zero=False)
        before = held_bytes(self.ctx)
        self.state = self.program.setup(self.ctx, shape)
        return held_bytes(self.ctx) - before

    def buffers(self, conn: Channel, go_handle: bytes | None) -> bytes | None:
        """The judge's block: input sets in{i}.<key> and outputs out{i}, call i of a batch using both."""
        tensors, self._keep = receive_buffers(conn)
        sets: dict[int, dict[str, torch.Tensor]] = {}
        outs: dict[int, torch.Tensor] = {}
        for key, tensor in tensors.items():
            if key.startswith("out"):
                outs[int(key[3:])] = tensor
            else:
                index, _, name = key.partition(".")
                sets.setdefault(int(index[2:]), {})[name] = tensor
        self.inputs = [sets[i] for i in sorted(sets)]
        self.outs = [outs[i] for i in sorted(outs)]
        if len(self.outs) != len(self.inputs):
            raise ValueError(f"{len(self.inputs)} input sets but {len(self.outs)} outputs")
        if self.symmetric is not None:
            like = self.outs[0]
            nbytes = like.numel() * like.element_size()
            self.symmetric = self.symmetric[:nbytes].view(like.dtype).view(like.shape)
        if not self.ctx.is_cuda:
            return None
        first, last = self.outs[0], self.outs[-1]
        base = self._keep.data_ptr()
        begin = first.data_ptr() - base
        self.out_bytes = self._keep[begin:last.data_ptr() - base + last.numel() * last.element_size()]
        self.out_stride = self.out_bytes.numel() if len(self.outs) == 1 else self.outs[1].data_ptr() - first.data_ptr()
        self.samples = sample_offsets(len(self.outs), self.out_stride, first.numel() * first.element_size(),
                                      self.ctx.device)
        self.snapshot = torch.empty(self.samples.numel(), dtype=torch.uint8, device=self.ctx.device)
        self.go = torch.cuda.Event.from_ipc_handle(self.ctx.device, go_handle)
        self.done = torch.cuda.Event(interprocess=True)
        self._load_batch_kernels()
        return self.done.ipc_handle()

    def _load_batch_kernels(self) -> None:
        """Run once, untimed, the kernels a batch adds around the program's calls (the sampled copy,
        its comparison, the symmetric output's poison and copy out). CUDA loads a kernel on its first
        launch, and a load waits for the GPU: behind the judge's hold that blocked the first batch
        until the hold let go (0.25 s), once per program process."""
        torch.take(self.out_bytes, self.samples[:SAMPLES_PER_OUTPUT], out=self.snapshot[:SAMPLES_PER_OUTPUT])
        torch.equal(self.snapshot[:SAMPLES_PER_OUTPUT], torch.take(self.out_bytes, self.samples[:SAMPLES_PER_OUTPUT]))
        if self.symmetric is not None:
            poison_(self.symmetric)
            self.outs[0].copy_(self.symmetric)
        torch.cuda.synchronize(self.ctx.device)

    def batch(self, count: int, settle: bool) -> None:
        """`count` calls back to back, call i on input set i into output i. On GPUs the stream
        first waits for the judge's 'go' event, records 'done' after the last call (and its copy
        out of a symmetric output), then queues a copy of sampled bytes of the outputs as that
        stream left them (`sample_offsets`); `settle` checks it at once (else the judge asks for
        it after its timer stopped)."""
        if not 1 <= count <= len(self.inputs):
            raise ValueError(f"a batch of {count} calls on {len(self.inputs)} input sets")
        if self.ctx.is_cuda:
            torch.cuda.current_stream(self.ctx.device).wait_event(self.go)
        for i in range(count):
            if self.symmetric is not None:
                poison_(self.symmetric)
            target = self.symmetric if self.symmetric is not None else self.outs[i]
            self.program.run(self.ctx, self.state, dict(self.inputs[i]), target)
            if self.symmetric is not None:
                self.outs[i].copy_(self.symmetric)
        if self.ctx.is_cuda:
            self.done.record()
            self.written = count * SAMPLES_PER_OUTPUT
            torch.take(self.out_bytes, self.samples[:self.written], out=self.snapshot[:self.written])
            if settle:
                self.settle()

    def settle(self) -> None:
        """The outputs as the current stream's work left them (the sampled copy queued after
        'done') must be the outputs once every stream is idle: a write that lands later (side-stream work not
        joined back before run() returned) escaped the judge's timed region. (One GPU time-slices
        the judge's and this process's contexts, so the judge's own check right after 'done' may
        only see the late write already landed.)"""
        if not self.ctx.is_cuda:
            return
        torch.cuda.synchronize(self.ctx.device)
        if not torch.equal(self.snapshot[:self.written], torch.take(self.out_bytes, self.samples[:self.written])):
            raise WorkEscapedStream("its output changed after run() returned and its work on the current stream "
                                    "ended: work left on a side stream escapes the timed region (join side "
                                    "streams back before returning)")

    def memory(self) -> int:
        """What two calls add at their peak and keep (workspaces, graph pools)."""
        torch.cuda.current_stream(self.ctx.device).wait_event(self.go)  # the judge's writes to the inputs
        torch.cuda.synchronize(self.ctx.device)
        before = held_bytes(self.ctx)
        torch.cuda.reset_peak_memory_stats(self.ctx.device)
        target = self.symmetric if self.symmetric is not None else self.outs[0]
        for _ in range(2):
            self.program.run(self.ctx, self.state, dict(self.inputs[0]), target)
        torch.cuda.synchronize(self.ctx.device)
        peak = torch.cuda.max_memory_allocated(self.ctx.device) + self.ctx.symmetric_bytes_in_use()
        return max(peak - before, held_bytes(self.ctx) - before, 0)

    def teardown(self) -> None:
        teardown = getattr(self.program, "teardown", None)
        if teardown is not None:
            teardown(self.ctx, self.state)
        self.ctx.end_candidate()


def serve(ctx: ProgramContext, conn: Channel) -> None:
    """Answer the judge's requests until 'exit'; a sticky CUDA error ends the process after its
    answer (the context is gone). Errors cross as strings, cut to what the wire carries."""
    served = _Served(ctx)
    while True:
        request = conn.receive(None)
        op, args = request["op"], request["args"]
        try:
            if op == "load":
                value = served.load(*args)
            elif op == "setup":
                label, params, symmetric = args
                value = served.setup(Shape(label, params), symmetric)
            elif op == "buffers":
                value = served.buffers(conn, None if args[0] is None else decode_bytes(args[0]))
                value = None if value is None else encode_bytes(value)
            elif op == "batch":
                value = served.batch(*args)
            elif op == "settle":
                value = served.settle()
            elif op == "memory":
                value = served.memory()
            elif op == "teardown":
                value = served.teardown()
            elif op == "exit":
                conn.send({"ok": None})
                return
            else:
                raise ValueError(f"unknown request {op!r}")
        except Exception as exc:  # noqa: BLE001 - the judge classifies it
            message = str(exc)
            conn.send({"error": {"type": type(exc).__name__, "message": message[:MESSAGE_CHARS],
                                 "traceback": traceback.format_exc()[-TRACEBACK_CHARS:]}})
            if is_sticky_cuda_error(f"{type(exc).__name__}: {message}"):
                return
            continue
        conn.send({"ok": value})
