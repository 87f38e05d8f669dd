"""Static analysis of a host-driven program: what the fast path must convert.

A Python program is read with `ast`: torch.distributed collectives and point-to-point calls with
their buffers (argument expressions), async handles and where they are waited on, streams, and
synchronization points. A CUDA file is read with regular expressions (comments stripped first):
host NCCL calls with their buffers and stream, groups, CUDA streams and events, device syncs. The
report names line numbers, so a model can point at what it replaces, and renders as a prompt
section. Nothing is executed.
"""

from __future__ import annotations

import ast
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from commweave.contracts.program import python_ast

PYTHON_SUFFIXES = (".py",)
CUDA_SUFFIXES = (".cu", ".cuh", ".cpp", ".cc", ".cxx")

#: torch.distributed functions that move data between ranks (host-issued)
TORCH_COLLECTIVES = (
    "all_gather", "all_gather_into_tensor", "all_gather_single", "all_reduce", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "broadcast", "gather", "scatter", "send", "recv",
    "isend", "irecv", "batch_isend_irecv", "P2POp",
)
_ALWAYS_ASYNC = ("isend", "irecv", "batch_isend_irecv")
#: keyword arguments that configure a collective rather than name a buffer
_OPTION_KEYWORDS = ("group", "async_op", "op", "src", "dst", "group_src", "group_dst", "tag", "peer", "group_peer")
#: ctx methods that build device infrastructure (runtime/context.py)
_DEVICE_METHODS = ("symmetric", "window", "dev_comm", "peer_ptrs", "peer_tensor", "compile", "device_barrier")

NCCL_COLLECTIVES = (
    "ncclAllGather", "ncclAllReduce", "ncclReduceScatter", "ncclBroadcast", "ncclBcast", "ncclReduce", "ncclSend",
    "ncclRecv", "ncclAlltoAll", "ncclGather", "ncclScatter",
)
_NCCL_ONE_BUFFER = ("ncclSend", "ncclRecv", "ncclBcast")
_CUDA_STREAM_CALLS = ("cudaStreamCreate", "cudaStreamCreateWithFlags", "cudaStreamCreateWithPriority")
_CUDA_SYNC_CALLS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventCreate", "cudaEventCreateWithFlags",
                    "cudaEventRecord", "cudaEventSynchronize", "cudaStreamWaitEvent", "ncclGroupStart", "ncclGroupEnd",
                    "MPI_Barrier")
_CUDA_DEVICE_CALLS = ("ncclMemAlloc", "ncclCommWindowRegister", "ncclDevCommCreate", "ncclCommRegister",
                      "ncclGetLsaPointer")
_CUDA_CALL = re.compile(r"\b(nccl[A-Z]\w*|cuda[A-Z]\w*|MPI_Barrier)\s*\(")


class AnalysisError(ValueError):
    """The file cannot be analysed as a host-driven program (wrong kind, unparsable, no collective)."""


@dataclass(frozen=True)
class Collective:
    """One host-issued communication call."""

    name: str  # e.g. "all_gather_into_tensor" or "ncclAllGather"
    line: int
    code: str  # the call as written (shortened)
    function: str | None = None  # enclosing Python function
    buffers: tuple[str, ...] = ()  # argument expressions naming the data moved
    options: tuple[str, ...] = ()  # group=..., op=..., the CUDA stream, ...
    is_async: bool = False
    handle: str | None = None  # where the async work object is kept
    waited_at: tuple[int, ...] = ()  # lines that wait on the handle
    indirect: bool = False  # referenced here and called elsewhere (e.g. kept in a dict)


@dataclass(frozen=True)
class Site:
    """A stream, a synchronization point, or device infrastructure, where it appears."""

    kind: str  # e.g. "stream", "with stream", "synchronize", "event record", "barrier", "symmetric"
    line: int
    code: str
    function: str | None = None


@dataclass
class ProgramAnalysis:
    """What a host-driven program does, by line."""

    name: str
    language: str  # "python" | "cuda"
    collectives: list[Collective] = field(default_factory=list)
    streams: list[Site] = field(default_factory=list)
    sync_points: list[Site] = field(default_factory=list)
    device: list[Site] = field(default_factory=list)  # symmetric buffers, windows, device comms, kernels
    functions: list[str] = field(default_factory=list)  # Python: module-level functions

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def collective_lines(self) -> list[int]:
        return sorted({c.line for c in self.collectives})

    def render_prompt(self) -> str:
        """A prompt section: every collective, stream, sync point and piece of device code, by line."""
        kind = "Python, torch.distributed" if self.language == "python" else "CUDA, host NCCL calls"
        lines = [f"## Static analysis of `{self.name}` ({kind})", ""]
        if self.functions:
            lines += [f"Module-level functions: {', '.join(self.functions)}", ""]
        lines.append(f"Host-issued communication ({len(self.collectives)}):")
        for c in self.collectives:
            where = f"line {c.line}" + (f", in {c.function}()" if c.function else "")
            parts = []
            if c.buffers:
                parts.append("buffers: " + ", ".join(f"`{b}`" for b in c.buffers))
            if c.options:
                parts.append("options: " + ", ".join(f"`{o}`" for o in c.options))
            if c.indirect:
                parts.append("referenced here, called indirectly")
            elif c.name == "P2POp":
                parts.append("a point-to-point op, issued by batch_isend_irecv")
            elif self.language == "cuda":
                parts.append("queued on its stream (host order: the sync points below)")
            elif c.is_async:
                waits = f"waited at line {', '.join(map(str, c.waited_at))}" if c.waited_at else "never waited on here"
                parts.append(f"async (handle `{c.handle}`, {waits})" if c.handle else f"async, {waits}")
            else:
                parts.append("blocking: ordered on the current stream")
            lines.append(f"- {where}: `{c.name}` — {'; '.join(parts)}")
            lines.append(f"    `{c.code}`")
        for title, sites, empty in (
            ("Streams", self.streams, "none: everything runs on the current stream"),
            ("Synchronization points", self.sync_points, "none besides the collectives themselves"),
            ("Device infrastructure already present", self.device, "none"),
        ):
            lines.append("")
            lines.append(f"{title} ({len(sites)}):" if sites else f"{title}: {empty}")
            for s in sites:
                where = f"line {s.line}" + (f", in {s.function}()" if s.function else "")
                lines.append(f"- {where}: {s.kind} — `{s.code}`")
        return "\n".join(lines) + "\n"


def _short(text: str, limit: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- Python ---------------------------------------------------------------------------------------
class _PythonVisitor(ast.NodeVisitor):
    def __init__(self, tree: ast.Module):
        self.aliases: dict[str, str] = {}
        self.parents: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        self.aliases[a.asname] = a.name
                    else:
                        top = a.name.split(".")[0]
                        self.aliases[top] = top
            elif isinstance(node, ast.ImportFrom) and node.module:
                for a in node.names:
                    self.aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        self.collectives: list[dict[str, Any]] = []
        self.streams: list[Site] = []
        self.sync: list[Site] = []
        self.device: list[Site] = []
        self.waits: list[tuple[str, int, str | None]] = []  # (expression waited on, line, function)
        self.loop_alias: dict[str, str] = {}  # `for w in works:` -> w: works
        self._function: list[str] = []
        self._called: set[int] = set()  # ids of Attribute nodes that are a call's function

    def dotted(self, node: ast.AST) -> str | None:
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id, node.id)
        if isinstance(node, ast.Attribute):
            base = self.dotted(node.value)
            return f"{base}.{node.attr}" if base else None
        return None

    @property
    def function(self) -> str | None:
        return self._function[-1] if self._function else None

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._function.append(node.name)
        self.generic_visit(node)
        self._function.pop()

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_For(self, node: ast.For) -> None:
        if isinstance(node.target, ast.Name):
            self.loop_alias[node.target.id] = ast.unparse(node.iter)
        self.generic_visit(node)

    def visit_With(self, node: ast.With) -> None:
        for item in node.items:
            expr = item.context_expr
            if isinstance(expr, ast.Call) and self.dotted(expr.func) in ("torch.cuda.stream", "torch.cuda.StreamContext"):
                self.streams.append(Site("with stream", node.lineno, _short(f"with {ast.unparse(expr)}:"), self.function))
        self.generic_visit(node)

    def _site(self, kind: str, node: ast.AST) -> Site:
        return Site(kind, node.lineno, _short(ast.unparse(node)), self.function)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        name = self.dotted(node)
        parent = self.parents.get(node)
        op_of_p2p = isinstance(parent, ast.Call) and (self.dotted(parent.func) or "").endswith(".P2POp")
        if id(node) not in self._called and not op_of_p2p and name and name.startswith("torch.distributed.") \
                and node.attr in TORCH_COLLECTIVES:
            self._add_collective(node.attr, node, indirect=True)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        self._called.add(id(node.func))
        name = self.dotted(node.func) or ""
        attr = node.func.attr if isinstance(node.func, ast.Attribute) else name.rsplit(".", 1)[-1]
        owner = ast.unparse(node.func.value) if isinstance(node.func, ast.Attribute) else ""
        if name.startswith("torch.distributed.") and attr in TORCH_COLLECTIVES:
            self._add_collective(attr, node)
        elif name == "getattr" and len(node.args) >= 2 and self.dotted(node.args[0]) == "torch.distributed" \
                and isinstance(node.args[1], ast.Constant) and node.args[1].value in TORCH_COLLECTIVES:
            self._add_collective(node.args[1].value, node, indirect=True)
        elif name in ("torch.distributed.barrier", "torch.distributed.monitored_barrier"):
            self.sync.append(self._site("barrier (host, all ranks)", node))
        elif name in ("torch.cuda.Stream", "torch.cuda.current_stream", "torch.cuda.default_stream"):
            self.streams.append(self._site(name.rsplit(".", 1)[-1], node))
        elif name == "torch.cuda.synchronize":
            self.sync.append(self._site("device synchronize", node))
        elif name == "torch.cuda.Event":
            self.sync.append(self._site("event created", node))
        elif owner == "ctx" and attr == "stream":
            self.streams.append(self._site("ctx side stream", node))
        elif owner == "ctx" and attr in ("barrier", "synchronize"):
            self.sync.append(self._site(f"ctx.{attr}", node))
        elif owner == "ctx" and attr in _DEVICE_METHODS:
            (self.sync if attr == "device_barrier" else self.device).append(self._site(f"ctx.{attr}", node))
        elif attr == "launch" and owner:
            self.device.append(self._site("kernel launch", node))
        elif attr == "wait_stream":
            self.sync.append(self._site("stream waits for stream", node))
        elif attr == "wait_event":
            self.sync.append(self._site("stream waits for event", node))
        elif attr == "record":
            self.sync.append(self._site("event record", node))
        elif attr == "synchronize" and owner:
            self.sync.append(self._site(f"{owner}.synchronize", node))
        elif attr == "wait" and owner and not node.args:
            self.waits.append((owner, node.lineno, self.function))
        self.generic_visit(node)

    def _add_collective(self, name: str, node: ast.AST, indirect: bool = False) -> None:
        buffers: list[str] = []
        options: list[str] = []
        is_async = name in _ALWAYS_ASYNC or name == "P2POp"
        if isinstance(node, ast.Call) and not indirect:
            buffers = [ast.unparse(a) for a in node.args]
            for kw in node.keywords:
                text = f"{kw.arg}={ast.unparse(kw.value)}" if kw.arg else f"**{ast.unparse(kw.value)}"
                (options if kw.arg in _OPTION_KEYWORDS else buffers).append(text)
                if kw.arg == "async_op" and not (isinstance(kw.value, ast.Constant) and kw.value.value is False):
                    is_async = True
            if name == "P2POp" and node.args:  # P2POp(dist.isend, tensor, peer): the op is an option
                options.insert(0, buffers.pop(0))
                if len(buffers) > 1:
                    options.append(f"peer={buffers.pop(1)}")
            elif name in ("send", "recv", "isend", "irecv") and len(buffers) > 1:
                options.insert(0, f"peer={buffers.pop(1)}")
        handle = None
        parent = self.parents.get(node)
        if is_async and isinstance(parent, (ast.Assign, ast.AnnAssign)):
            target = parent.targets[0] if isinstance(parent, ast.Assign) else parent.target
            handle = ast.unparse(target)
        line = getattr(node, "lineno", 0)
        self.collectives.append(dict(name=name, line=line, code=_short(ast.unparse(node)), function=self.function,
                                     buffers=tuple(buffers), options=tuple(options), is_async=is_async,
                                     handle=handle, indirect=indirect))

    def result(self) -> tuple[list[Collective], list[Site]]:
        """Collectives with their waits resolved; waits on nothing known become sync points."""
        out: list[Collective] = []
        matched: set[tuple[str, int]] = set()
        for c in self.collectives:
            waited: list[int] = []
            if c["handle"]:
                for owner, line, _ in self.waits:
                    if owner == c["handle"] or self.loop_alias.get(owner) == c["handle"]:
                        waited.append(line)
                        matched.add((owner, line))
            out.append(Collective(**c, waited_at=tuple(sorted(waited))))
        others = [Site("wait()", line, f"{owner}.wait()", function) for owner, line, function in self.waits
                  if (owner, line) not in matched]
        return out, others


def _analyze_python(text: str, name: str) -> ProgramAnalysis:
    try:
        tree = python_ast(text)
    except SyntaxError as exc:
        raise AnalysisError(f"{name}: syntax error at line {exc.lineno}: {exc.msg}") from exc
    visitor = _PythonVisitor(tree)
    visitor.visit(tree)
    collectives, other_waits = visitor.result()
    return ProgramAnalysis(
        name=name, language="python",
        collectives=sorted(collectives, key=lambda c: c.line),
        streams=sorted(visitor.streams, key=lambda s: s.line),
        sync_points=sorted(visitor.sync + other_waits, key=lambda s: s.line),
        device=sorted(visitor.device, key=lambda s: s.line),
        functions=[n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))],
    )


# -- CUDA -----------------------------------------------------------------------------------------
def _strip_comments(text: str) -> str:
    """Comments replaced by spaces (newlines kept, so offsets still give line numbers)."""
    def blank(match: re.Match[str]) -> str:
        return re.sub(r"[^\n]", " ", match.group(0))

    return re.sub(r"//[^\n]*|/\*.*?\*/", blank, text, flags=re.DOTALL)


def _call_arguments(text: str, open_paren: int) -> tuple[list[str], int]:
    """Top-level comma-separated arguments of the call whose '(' is at `open_paren`, and the index
    after its ')'."""
    depth, args, start = 0, [], open_paren + 1
    for i in range(open_paren, len(text)):
        ch = text[i]
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                last = text[start:i].strip()
                if last or args:
                    args.append(last)
                return [" ".join(a.split()) for a in args], i + 1
        elif ch == "," and depth == 1:
            args.append(text[start:i].strip())
            start = i + 1
    return [" ".join(a.split()) for a in args], len(text)


def _analyze_cuda(text: str, name: str) -> ProgramAnalysis:
    code = _strip_comments(text)
    report = ProgramAnalysis(name=name, language="cuda")
    group_open: int | None = None
    for match in _CUDA_CALL.finditer(code):
        call = match.group(1)
        line = code.count("\n", 0, match.start()) + 1
        args, end = _call_arguments(code, match.end() - 1)
        written = _short(code[match.start():end])
        if call in NCCL_COLLECTIVES:
            nbuf = 1 if call in _NCCL_ONE_BUFFER else 2
            options = [f"stream={args[-1]}"] if len(args) > nbuf else []
            if call in ("ncclSend", "ncclRecv") and len(args) >= 4:
                options.insert(0, f"peer={args[3]}")
            if group_open is not None:
                options.append(f"inside the ncclGroupStart at line {group_open}")
            report.collectives.append(Collective(call, line, written, None, tuple(args[:nbuf]), tuple(options), is_async=True))
        elif call in _CUDA_STREAM_CALLS:
            report.streams.append(Site(call, line, written))
        elif call in _CUDA_SYNC_CALLS:
            if call == "ncclGroupStart":
                group_open = line
            elif call == "ncclGroupEnd":
                group_open = None
            report.sync_points.append(Site(call, line, written))
        elif call in _CUDA_DEVICE_CALLS:
            report.device.append(Site(call, line, written))
    for match in re.finditer(r"\b(\w+)\s*<<<", code):
        line = code.count("\n", 0, match.start()) + 1
        report.device.append(Site("kernel launch", line, _short(code[match.start():code.find(";", match.start()) + 1])))
    report.device.sort(key=lambda s: s.line)
    return report


# -- entry points ---------------------------------------------------------------------------------
def language_of(path: Path | str) -> str:
    suffix = Path(path).suffix.lower()
    if suffix in PYTHON_SUFFIXES:
        return "python"
    if suffix in CUDA_SUFFIXES:
        return "cuda"
    raise AnalysisError(f"{path} is neither a Python file ({', '.join(PYTHON_SUFFIXES)}) nor a CUDA file "
                        f"({', '.join(CUDA_SUFFIXES)}): the fast path reads host-driven programs of those two kinds")


def analyze_source(text: str, language: str, name: str = "program") -> ProgramAnalysis:
    """Analyse program text of `language` ("python" or "cuda"); an empty report is not an error
    here (the fast path uses this to check that a rewrite left no host collective)."""
    if language == "python":
        return _analyze_python(text, name)
    if language == "cuda":
        return _analyze_cuda(text, name)
    raise AnalysisError(f"unknown language {language!r}: expected 'python' or 'cuda'")


def analyze_program(path: Path | str) -> ProgramAnalysis:
    """Analyse a host-driven input program; AnalysisError when it is of another kind, cannot be
    read, or issues no host collective (then there is nothing for the fast path to convert)."""
    path = Path(path)
    language = language_of(path)
    if not path.is_file():
        raise AnalysisError(f"{path}: no such file")
    report = analyze_source(path.read_text(), language, path.name)
    if not report.collectives:
        looked = (", ".join(f"torch.distributed.{n}" for n in TORCH_COLLECTIVES) if language == "python"
                  else ", ".join(NCCL_COLLECTIVES))
        raise AnalysisError(f"{path} issues no host collective (looked for {looked}): the fast path converts "
                            "host-driven programs, and this one has no communication to convert")
    return report
