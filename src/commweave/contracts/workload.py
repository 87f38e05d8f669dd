"""What a workload is: shapes, inputs, a reference, costs for the floor, and its programs.

A workload folder holds `workload.py` (a `Workload` subclass), `programs/*.py` (the host baseline,
peer baselines and our device-initiated seed, all written as candidate programs, so baselines go
through exactly the same correctness checks and timing as candidates) and `NOTES.md` (each
version's measured numbers). Copy `gemm_allgather/` to add the next one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from commweave.contracts.profile import COMPRESSION_ERROR, MAX_GROUP
from commweave.contracts.program import with_config

#: the declared tolerance of the "-lossy" variants (gemm-allgather-lossy, moe-lossy), for callers who
#: accept lossy communication as tensor-parallel training does with activations: above FP8 E4M3's
#: expected error (space.COMPRESSION_ERROR, 0.036; measured 0.026 on Gaussian rows with TACO,
#: bench/results/taco-error-table.md), below E5M2's (0.072), so the design space admits E4M3 only
LOSSY_TOLERANCE = 0.04


def seeded_generator(device: torch.device, *key: int) -> torch.Generator:
    """A generator determined by `key` (seed, stream, rank, ...): any rank can redraw any other
    rank's inputs, so references are computed from pristine data, never from a program's tensors."""
    gen = torch.Generator(device=device)
    h = 0
    for k in key:
        h = (h * 1_000_003 + k + 7) % (2**63)
    gen.manual_seed(h)
    return gen


def bf16_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a @ b` in FP32 for bf16 operands, as a reference computes it. On GPUs it runs on TF32
    tensor cores: a bf16 value is exact in TF32 (8 significand bits of its 11), so every product
    is exact and the sums are FP32's, the accuracy of an FP32 matmul at several times its speed
    (the judge computes one per verified call of a timed batch; FP32 takes 2.7 ms at 4096^3 on an
    H100)."""
    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16:
        raise ValueError(f"bf16_product takes bf16 operands, got {a.dtype} and {b.dtype}")
    if not a.is_cuda:
        return torch.matmul(a.float(), b.float())
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")  # TF32
    try:
        return torch.matmul(a.float(), b.float())
    finally:
        torch.set_float32_matmul_precision(before)


@dataclass(frozen=True)
class Shape:
    """One problem size, e.g. Shape('8192x8192x8192', {'M': 8192, 'N': 8192, 'K': 8192}). A str
    parameter is what a program's setup needs beyond sizes (a problem's constant arguments)."""

    label: str
    params: Mapping[str, int | str] = field(default_factory=dict)

    def __getitem__(self, key: str) -> int:
        """The size `key`."""
        value = self.params[key]
        if not isinstance(value, int):
            raise TypeError(f"shape {self.label}'s parameter {key!r} is not a size")
        return value

    def __str__(self) -> str:
        return self.label


@dataclass(frozen=True)
class Cost:
    """Per-rank work of one call, for the physical floor."""

    flops: float = 0.0  # matrix-unit floating-point operations
    comm_bytes: float = 0.0  # bytes this rank must receive from peers, in the workload's dtype
    memory_bytes: float = 0.0  # bytes this rank must move through its own HBM (each read/write once)
    #: the fewest bytes a program the workload admits can send per byte of comm_bytes (the floor's
    #: link term): 1 when the data must arrive exactly, less where a tolerance admits compression
    #: (`Workload.wire_ratio`); the search's cost model compresses comm_bytes itself
    wire_ratio: float = 1.0


class Workload(ABC):
    """A multi-GPU computation with a reference and the programs that implement it."""

    name: str = ""
    summary: str = ""
    dtype: torch.dtype = torch.bfloat16
    world_sizes: tuple[int, ...] = (2, 4)
    #: names of programs that are baselines (timed side by side); the first is the fitness baseline
    baselines: tuple[str, ...] = ("host",)
    #: the device-initiated program the fast path produces
    seed: str = "seed"
    #: on CUDA pools the harness allocates each rank's output in a symmetric window (same shape and
    #: dtype as `make_output`), so device programs can store straight into peers' outputs
    #: (`ctx.window(out)`); CPU pools still use `make_output`
    symmetric_output: bool = False
    #: yardsticks: name -> (program, CONFIG overrides) timed beside the programs as a physical
    #: reference, e.g. the compute alone with every input already present. Not correct programs
    #: (they skip the communication), so they are never checked, only timed (`bench`)
    yardsticks: dict[str, tuple[str, dict[str, Any]]] = {}
    #: yardsticks that only move the call's data: `bench` reports their bandwidth (`cost()`'s
    #: comm_bytes over their time) beside the measured peer-copy rate
    comm_yardsticks: tuple[str, ...] = ()
    #: the tensors of one call in order, named as in `make_inputs` (those a user passes: no stand-in
    #: extras), e.g. ("a", "b"): `commweave.ops` hands them to its generic custom op in this order,
    #: so no op code names a workload's inputs; empty: the caller's names, sorted
    op_inputs: tuple[str, ...] = ()
    #: whether a program that writes to its inputs fails (its inputs are compared with pristine
    #: copies after judged calls). False where programs are other people's code that may work in
    #: place (problems: `dist.all_reduce(x)` on an argument) and the reference is drawn from the
    #: seed alone: their calls then need no defensive copy of every input inside the timed region
    inputs_read_only: bool = True

    @property
    def programs_dir(self) -> Path:
        import inspect

        return Path(inspect.getfile(type(self))).parent / "programs"

    def program_names(self) -> list[str]:
        return sorted(p.stem for p in self.programs_dir.glob("*.py"))

    def program_text(self, name: str) -> str:
        path = self.programs_dir / f"{name}.py"
        if not path.exists():
            raise KeyError(f"workload {self.name!r} has no program {name!r} (has: {', '.join(self.program_names())})")
        return path.read_text()

    def yardstick_text(self, name: str) -> str:
        """The program text of yardstick `name`: its program with the yardstick's CONFIG."""
        if name not in self.yardsticks:
            raise KeyError(f"workload {self.name!r} has no yardstick {name!r} (has: {', '.join(self.yardsticks) or 'none'})")
        program, config = self.yardsticks[name]
        return with_config(self.program_text(program), **config)

    def check_world_size(self, world_size: int) -> None:
        if world_size not in self.world_sizes:
            sizes = ", ".join(map(str, self.world_sizes))
            raise ValueError(f"workload {self.name!r} runs on {sizes} GPUs, not {world_size}")

    @abstractmethod
    def bench_shapes(self, world_size: int) -> list[Shape]:
        """The shapes `commweave bench` times by default."""

    @abstractmethod
    def check_shapes(self, world_size: int) -> list[Shape]:
        """Small shapes for correctness: at least two, one not a multiple of any tile size."""

    @abstractmethod
    def parse_shape(self, text: str, world_size: int) -> Shape:
        """A shape from the command line; a clear ValueError for a bad one."""

    @abstractmethod
    def make_inputs(self, shape: Shape, world_size: int, rank: int, seed: int, device: torch.device) -> dict[str, torch.Tensor]:
        """This rank's inputs, a deterministic function of (shape, world_size, rank, seed)."""

    @abstractmethod
    def make_output(self, shape: Shape, world_size: int, rank: int, device: torch.device) -> torch.Tensor:
        """This rank's output buffer (the harness poisons it before every run)."""

    @abstractmethod
    def reference(self, shape: Shape, world_size: int, rank: int, seed: int, device: torch.device) -> torch.Tensor:
        """This rank's expected output in float32, from freshly generated (pristine) inputs."""

    @abstractmethod
    def cost(self, shape: Shape, world_size: int) -> Cost:
        """Per-rank FLOPs and bytes of one call."""

    def prepare_inputs(self, shape: Shape, world_size: int, rank: int, seeds: list[int], device: torch.device) -> None:
        """The seeds the judge draws next with `make_inputs`, in order (a batch's): a workload whose
        draws cost a round trip each (a problem's reference workers) makes them together. Default:
        nothing (draws are made one by one)."""

    def untouched(self, shape: Shape, world_size: int, rank: int, seed: int, device: torch.device) -> torch.Tensor | None:
        """A bool mask of output elements a correct program never writes (they must keep the
        harness's poison), or None when every element is an output (the default)."""
        return None

    def template(self):  # -> commweave.space.Template
        """The design-space template that renders directive sets into this workload's programs
        (what `commweave evolve` searches). A workload without one cannot be searched yet."""
        raise LookupError(f"workload {self.name!r} has no template, so it cannot be searched yet")

    def tolerance(self) -> float:
        """Largest accepted relative Frobenius error against the reference."""
        return {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 5e-3}.get(self.dtype, 1e-2)

    def wire_ratio(self, values: int, item_bytes: int) -> float:
        """`Cost.wire_ratio` of rows of `values` elements of `item_bytes` each: 1 where the tolerance
        admits no compression (the design space's rule: a format's expected error within it), else
        FP8 with one FP32 scale per 512 values (the largest group the kernels take), the most
        compressed exchange it admits, so the floor stays a lower bound for every admitted program."""
        if not any(err <= self.tolerance() for err in COMPRESSION_ERROR.values()):
            return 1.0
        return (values + 4 * -(-values // MAX_GROUP)) / (values * item_bytes)

    # -- calls on a user's tensors (commweave.ops) ---------------------------------------------
    def single_rank(self, inputs: Mapping[str, torch.Tensor | None], out: torch.Tensor | None = None,
                    **options: Any) -> torch.Tensor:
        """The op's result on one rank (W = 1, nothing to communicate), computed locally from the
        tensors named as in `make_inputs` (and `out`, for a workload whose output the caller owns),
        so a TP = 1 configuration uses the same call. Default: the workload's own programs run only
        on its `world_sizes`, so without an override W = 1 is refused with the reason."""
        raise NotImplementedError(f"workload {self.name!r} has no single-rank computation, so its op needs a "
                                  "process group of 2 or more ranks (implement Workload.single_rank)")

    def op_options(self, shape: Shape) -> dict[str, Any]:
        """The options (`shape_from_inputs` keywords, e.g. attention's `causal`) a call of `shape`
        passes besides its tensors: what a caller who holds only the shape would pass."""
        return {}

    def shape_from_inputs(self, inputs: Mapping[str, torch.Tensor], world_size: int, rank: int,
                          out: torch.Tensor | None = None, **options: Any) -> Shape:
        """The shape of a call on this rank's tensors (named as in `make_inputs`), so a user's
        tensors can be run by the workload's programs (`commweave.ops`). `out` is passed for a
        workload whose output the caller owns (kv-transfer's paged cache); `options` carry what
        the tensors cannot say (attention's `causal`). A clear ValueError names a tensor of the
        wrong shape, dtype or device; the same shape must come out on every rank (setup is
        collective)."""
        raise NotImplementedError(f"workload {self.name!r} cannot derive a shape from tensors, so it has no op yet "
                                  "(implement shape_from_inputs in its Workload)")


def input_names(inputs: Mapping[str, Any], required: tuple[str, ...], optional: tuple[str, ...] = ()) -> None:
    """A ValueError naming missing or unknown inputs (a user's tensors, by `make_inputs` names)."""
    missing = [n for n in required if inputs.get(n) is None]
    unknown = sorted(set(inputs) - set(required) - set(optional))
    if missing:
        raise ValueError(f"missing input {', '.join(missing)} (expects {', '.join(required + optional)})")
    if unknown:
        raise ValueError(f"unexpected input {', '.join(unknown)} (expects {', '.join(required + optional)})")


def checked_tensor(name: str, value: Any, dims: int, dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
    """`value` if it is a tensor with `dims` dimensions, `dtype` and (when given) on `device`; else
    a ValueError that names the input and what is wrong."""
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, not {type(value).__name__}")
    if value.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimensions, got shape {tuple(value.shape)}")
    if value.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {value.dtype}")
    if device is not None and value.device != device:
        raise ValueError(f"{name} is on {value.device}, but the other tensors are on {device}")
    return value


def check_matmul_operands(a: torch.Tensor, b: torch.Tensor) -> None:
    """A ValueError unless `a @ b` is a product of two matrices (a GEMM op's operands)."""
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"a and b must be 2-D, got shapes {tuple(a.shape)} and {tuple(b.shape)}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"a has {a.shape[1]} columns but b {b.shape[0]} rows")
