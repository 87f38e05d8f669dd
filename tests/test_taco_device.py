"""TACO's device-initiated compressed collectives (commweave.taco.device).

CPU: the algorithms run over an in-process fake transport (W ranks as threads, buffers in one dict,
a threading barrier; tests/taco_jobs.FakeNode) with the reference codec, and must equal the
reference backend's results over gloo (a CPU worker pool) bit for bit, call after call (buffer
reuse), single- and double-buffered; a hazard log shows that no rank reads a peer's buffer in the
barrier epoch its owner writes it. Bad inputs, the backend's resolution and its context per group
are checked without GPUs.

GPU (`pytest -m gpu tests/test_taco_device.py -s`, 2 and 4 GPUs): the real backend (symmetric
windows, LSA barriers, Triton kernels reading peers over NVLink) against the reference backend
over NCCL and against the CPU simulation, bit for bit; then algorithm bandwidth at 16 and 256 MiB
of BF16 against plain NCCL, printed.
"""

from __future__ import annotations

import contextlib
import os
import struct
import sys
import threading
from pathlib import Path

import pytest
import torch

import taco_jobs
from commweave.runtime import WorkerPool
from commweave.taco import collectives as cc
from commweave.taco import device
from commweave.taco.codec import CudaCodec
from commweave.taco.cuda import FusedBarrier
from commweave.taco.quant import QuantConfig, ReferenceCodec, compress

TESTS = Path(__file__).parent

# (op, QuantConfig kwargs, shape (reduce_scatter: dim 0 per rank), dtype, seed): ragged sizes
# (padding), every op, the main switches, 16-bit inputs, and repeats with new data (buffer reuse).
CASES: list[taco_jobs.Case] = [
    ("all_gather", {}, (6, 96), "float32", 1),
    ("reduce_scatter", {"group_size": 32, "fmt": "e5m2"}, (3, 37), "float32", 2),
    ("one_shot", {"group_size": 64, "hadamard": "adaptive"}, (5, 100), "bfloat16", 3),
    ("two_shot", {}, (7, 33), "float32", 4),
    ("two_shot", {"group_size": 64, "hadamard": False, "dual_scale": False}, (4, 256), "float16", 5),
    ("all_gather", {}, (6, 96), "float32", 6),
    ("all_gather", {}, (6, 96), "float32", 7),
    ("one_shot", {"group_size": 64, "hadamard": "adaptive"}, (5, 100), "bfloat16", 8),
    ("one_shot", {"group_size": 64, "hadamard": "adaptive"}, (5, 100), "bfloat16", 9),
    ("reduce_scatter", {"group_size": 32, "fmt": "e5m2"}, (3, 37), "float32", 10),
    ("two_shot", {}, (7, 33), "float32", 11),
    ("reduce_scatter", {"group_size": 128, "hadamard": False}, (2, 512), "bfloat16", 12),
    # whole 1024-element work items, each op, repeats with new data
    ("all_gather", {}, (8, 512), "float32", 21),
    ("reduce_scatter", {"group_size": 32, "fmt": "e5m2"}, (4, 768), "float32", 22),
    ("one_shot", {"group_size": 64, "hadamard": "adaptive"}, (2, 2048), "bfloat16", 23),
    ("two_shot", {}, (8, 1024), "float32", 24),
    ("all_gather", {}, (8, 512), "float32", 25),
    ("two_shot", {"group_size": 64, "hadamard": False, "dual_scale": False}, (8, 1024), "float16", 26),
    ("reduce_scatter", {"group_size": 32, "fmt": "e5m2"}, (4, 768), "float32", 27),
    ("one_shot", {"group_size": 64, "hadamard": "adaptive"}, (2, 2048), "bfloat16", 28),
]


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda n: f"{n}ranks")
def reference(request) -> tuple[int, list[list[torch.Tensor]]]:
    """(world, per rank the reference backend's result of each case over gloo)."""
    env = {"PYTHONPATH": os.pathsep.join([str(TESTS), *sys.path])}
    with WorkerPool(request.param, device="cpu", job_timeout_s=120, env=env) as pool:
        result = pool.run("taco_jobs:reference_results", cases=CASES)
    assert result.ok, result.first_failure().traceback if result.first_failure() else result.status
    return request.param, result.values


def _run_cases(coll: device.DeviceCollectives, rank: int, world: int) -> list[torch.Tensor]:
    return [taco_jobs.run_case(taco_jobs.device_call(coll), case, world, rank) for case in CASES]


@pytest.mark.parametrize("fuse_barriers", [False, True], ids=["barrier", "fused"])
@pytest.mark.parametrize("double_buffer", [False, True], ids=["single", "double"])
def test_device_algorithms_equal_the_reference_backend_bit_for_bit(reference, double_buffer, fuse_barriers):
    """Every case, call after call, equals the reference backend bit for bit; read barriers queued
    or handed to the reading calls (fused); no rank reads a peer's buffer without a barrier since
    its owner wrote it."""
    world, expected = reference
    got, node = taco_jobs.simulate(world, lambda coll, r: _run_cases(coll, r, world), double_buffer,
                                   fuse_barriers=fuse_barriers)
    for rank in range(world):
        results = got[rank]
        for i, case in enumerate(CASES):
            assert taco_jobs.same_bits(results[i], expected[rank][i]), (rank, i, case)
    assert node.hazards() == []
    # collective allocation: every rank asked for the same buffers in the same order
    assert all(node.allocations[r] == node.allocations[0] for r in range(world))
    keys = {key for key, _ in node.allocations[0]}
    assert {key[-1] for key in keys} == ({0, 1} if double_buffer else {0})  # call parity


def test_all_reduce_is_identical_on_every_rank_and_close_to_the_exact_sum():
    world = 4
    case: taco_jobs.Case = ("one_shot", {}, (8, 128), "float32", 21)
    xs = [taco_jobs.case_input(case, world, r) for r in range(world)]
    exact = sum(xs[1:], xs[0])

    def body(coll, r):
        return [coll.all_reduce(xs[r], QuantConfig(), algo) for algo in ("one_shot", "two_shot")]

    got, _ = taco_jobs.simulate(world, body)
    for i in range(2):
        assert all(taco_jobs.same_bits(got[r][i], got[0][i]) for r in range(world))
        assert float((got[0][i] - exact).norm() / exact.norm()) < 0.05


def _barriers(double: bool, op: str, calls: int, fuse: bool = False) -> int:
    """Barriers after `calls` back-to-back all-gathers or two-shots on 2 ranks, checked hazard-free."""
    x = torch.randn(4, 1024)

    def body(coll, r):
        for _ in range(calls):
            if op == "two_shot":
                coll.all_reduce(x, QuantConfig(), "two_shot")
            else:
                coll.all_gather(x, QuantConfig())
        return coll.barriers

    got, node = taco_jobs.simulate(2, body, double, fuse_barriers=fuse)
    assert node.hazards() == []
    return got[0]


@pytest.mark.parametrize("fuse", [False, True], ids=["barrier", "fused"])
def test_barriers_per_call_single_vs_double_buffered(fuse):
    """Single buffer: back-to-back single-phase calls need a barrier before rewriting (two per call,
    the first call excepted); double buffer: one. Two-shot: its own two, either way. A read barrier
    fused into the reading call counts as one (it covers the earlier reads alike)."""
    assert _barriers(False, "all_gather", 3, fuse=fuse) == 5 and _barriers(True, "all_gather", 3, fuse=fuse) == 3
    assert _barriers(False, "two_shot", 3, fuse=fuse) == 6 and _barriers(True, "two_shot", 3, fuse=fuse) == 6


def test_a_fused_barrier_the_reading_call_skips_is_caught_by_the_hazard_log():
    """The checker is not vacuous for fused barriers: a codec that takes the token but reads without
    the barrier is reported, for each kind of reading call."""

    class Skips(taco_jobs.TracingCodec):
        def _reads(self, parts, barrier, skip=None):
            super()._reads(parts, None, skip)

    x = torch.randn(4, 1024)
    for op in ("all_gather", "reduce_scatter", "two_shot"):
        node = taco_jobs.FakeNode(2)

        def run(rank: int) -> None:
            t = taco_jobs.FakeTransport(node, rank)
            coll = device.DeviceCollectives(t, Skips(ReferenceCodec(), t, fuse_barriers=True))
            {"all_gather": lambda: coll.all_gather(x, QuantConfig()),
             "reduce_scatter": lambda: coll.reduce_scatter(x, QuantConfig()),
             "two_shot": lambda: coll.all_reduce(x, QuantConfig(), "two_shot")}[op]()

        threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert any("before any write" in h or "with no barrier between" in h for h in node.hazards()), op


def test_codecs_without_fused_barriers_refuse_the_token():
    token = FusedBarrier(signal=(), wait=(), epoch=1)
    c = compress(torch.randn(1024), QuantConfig())
    with pytest.raises(ValueError, match="does not fuse barriers"):
        ReferenceCodec().gather_into([c], torch.empty(1, 1024), token)
    with pytest.raises(ValueError, match="at most 8 ranks with an epoch >= 1"):
        FusedBarrier(signal=(), wait=(), epoch=0)


@pytest.mark.parametrize("double_buffer", [False, True], ids=["single", "double"])
def test_captured_calls_always_barrier_before_writing_and_so_do_later_writes_of_what_they_read(double_buffer):
    """A CUDA graph replays a captured call any number of times later, unseen by the lazy rule: a
    captured call barriers before its write, and so does every later write (eager too) of a buffer
    a captured call read; the results stay the reference's, with no hazard."""
    x = torch.randn(4, 128)
    cfg = QuantConfig()

    def body(coll, rank):
        def barriers_of_a_call(captured: bool) -> int:
            coll.t.captured = captured
            before = coll.barriers
            coll.all_gather(x * (rank + 1), cfg)
            return coll.barriers - before

        eager = [barriers_of_a_call(False) for _ in range(2)]
        captured = barriers_of_a_call(True)
        after = [barriers_of_a_call(False) for _ in range(5)]
        return eager, captured, after

    got, node = taco_jobs.simulate(2, body, double_buffer)
    eager, captured, after = got[0]
    assert captured == 2  # the rewrite barrier, then the read barrier
    if double_buffer:  # the captured call took buffer 0: its later writes barrier first, buffer 1 keeps the rule
        # (each, even after an eager call's barrier: a replay may come after that barrier)
        assert eager == [1, 1] and after == [1, 2, 1, 2, 1]
    else:  # one buffer, read by the captured call: every later write barriers first
        assert eager == [1, 2] and after == [2, 2, 2, 2, 2]
    assert got[1] == got[0] and node.hazards() == []


def test_a_missing_barrier_is_caught_by_the_hazard_log():
    """The checker is not vacuous: without the barrier before rewriting, it reports the race."""
    x = torch.randn(4, 128)

    class NoRewriteBarrier(device.DeviceCollectives):
        def _buffer(self, op, shape, dtype, cfg, nbytes):
            key = (op, shape, dtype, cfg, 0)
            return key, self.t.buffer(key, nbytes)

    node = taco_jobs.FakeNode(2)
    results = [None, None]

    def run(rank: int) -> None:
        t = taco_jobs.FakeTransport(node, rank)
        coll = NoRewriteBarrier(t, taco_jobs.TracingCodec(ReferenceCodec(), t))
        results[rank] = [coll.all_gather(x, QuantConfig()) for _ in range(2)]

    import threading

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert any("when it is written" in h for h in node.hazards())


class _SharedBuffers:
    """A W-rank view for one process: every rank's buffer per key (distinct addresses, shared by the
    transports made over one instance), no-op barriers, fused barriers with fixed flag addresses."""

    def __init__(self, world: int):
        self.world = world
        self.buffers: dict[tuple[int, object], torch.Tensor] = {}

    def transport(self, rank: int) -> "object":
        shared = self

        class Transport:
            def __init__(self):
                self.rank, self.world_size, self.device = rank, shared.world, torch.device("cpu")

            def buffer(self, key, nbytes):
                for r in range(shared.world):
                    if (r, key) not in shared.buffers:
                        raw = torch.zeros(nbytes + 16, dtype=torch.uint8)  # not an allocation of the call
                        shared.buffers[r, key] = raw[-raw.data_ptr() % 16:][:nbytes]
                return shared.buffers[rank, key]

            def peer(self, buf, r):
                return next(shared.buffers[r, k] for (o, k), b in shared.buffers.items()
                            if o == rank and b.data_ptr() == buf.data_ptr())

            def barrier(self):
                pass

            def capturing(self):
                return False

            def fused_barrier(self, epoch):
                others = [p for p in range(shared.world) if p != rank]
                return FusedBarrier(tuple(0x1000 + 8 * p for p in others), tuple(0x2000 + 8 * p for p in others), epoch)

        return Transport()


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("fuse_barriers", [False, True], ids=["barrier", "fused"])
@pytest.mark.parametrize("double_buffer", [False, True], ids=["single", "double"])
def test_replayed_launches_equal_the_checked_paths_byte_for_byte(monkeypatch, world, fuse_barriers, double_buffer):
    """Calls that replay recorded launches queue exactly what the checked path queues for them (kernel,
    grid, every argument's value), call after call with new inputs and outputs, an input at an
    address the vector path does not take (a new recording), single- and double-buffered, with and
    without fused barriers; the replaying collectives do skip the checks after the first calls."""
    from commweave.taco import cuda

    launched: list[tuple] = []

    class Kernel:
        def __init__(self, name):
            self.name = name

        def __call__(self, grid, block, args):
            launched.append((self.name, grid, block, tuple(args)))

    class Module:
        def kernel(self, name):
            return Kernel(name)

    checks = {"count": 0}

    def check_result(parts, result, numel, what):  # the checked path ran (CPU tensors: no device check)
        checks["count"] += 1

    monkeypatch.setattr(cuda, "_module", lambda index, source: Module())
    monkeypatch.setattr(cuda, "_device_index", lambda dev: 0)
    monkeypatch.setattr(cuda, "_sm_count", lambda index: 132)
    monkeypatch.setattr(cuda, "on_device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(cuda, "_check_result", check_result)
    cfg = QuantConfig(64)
    shared = _SharedBuffers(world)
    rank = world - 1
    replaying = device.DeviceCollectives(shared.transport(rank), CudaCodec(fuse_barriers=fuse_barriers), double_buffer)
    checked = device.DeviceCollectives(shared.transport(rank), CudaCodec(fuse_barriers=fuse_barriers), double_buffer)
    checked._replay_key = lambda *a: None  # every call takes the checked path
    gen = torch.Generator().manual_seed(world)

    def call(coll, op, x):
        """The call's launches, each address inside a tensor the call allocated (its output, a padded
        input) written as (that tensor's index, offset); and how many result checks it ran."""
        start, before, made = len(launched), checks["count"], []
        with monkeypatch.context() as m:
            for owner, name in ((torch, "empty"), (torch, "empty_like"), (torch.nn.functional, "pad")):
                m.setattr(owner, name, lambda *a, _f=getattr(owner, name), **k: made.append(_f(*a, **k)) or made[-1])
            if op == "all_gather":
                coll.all_gather(x, cfg)
            elif op == "reduce_scatter":
                coll.reduce_scatter(x, cfg)
            else:
                coll.all_reduce(x, cfg, op)

        def where(v):
            for j, t in enumerate(made):
                if t.data_ptr() <= v < t.data_ptr() + t.numel() * t.element_size():
                    return ("made", j, v - t.data_ptr())
            return v

        def value(a):
            if isinstance(a, bytes):
                return tuple(where(v) for v in struct.unpack(f"<{len(a) // 8}Q", a))
            return where(a) if a > 1 << 16 else a

        return [(name, grid, block, tuple(map(value, args))) for name, grid, block, args in launched[start:]], \
            checks["count"] - before

    replayed_checks = 0
    for i in range(5):
        for op, shape in (("all_gather", (3, 64)), ("reduce_scatter", (world * 2, 96)), ("one_shot", (5, 64)),
                          ("two_shot", (7, 33))):
            base = torch.randn(shape[0] * shape[1] + 1, generator=gen, dtype=torch.bfloat16)
            x = (base[1:] if i == 3 else base[:-1]).view(shape)  # call 3: 2 bytes past an aligned address
            ours, n_checks = call(replaying, op, x)
            theirs, _ = call(checked, op, x)
            assert ours == theirs, (op, i)
            if i == 4:
                replayed_checks += n_checks
    assert replaying.barriers == checked.barriers
    # a strided input is read through a copy by the checked path: never replayed from its own address
    strided = torch.randn(64, 6, dtype=torch.bfloat16).t()
    assert replaying._replay_key("all_gather", tuple(strided.shape), strided.dtype, cfg,
                                 strided, torch.empty(world, *strided.shape, dtype=strided.dtype)) is None
    if world > 1:  # each layout's calls replay once recorded (one rank: only what launches kernels alone)
        assert replayed_checks == 0 and replaying.replays.replayable() == len(replaying.replays) > 0


def test_bad_inputs_are_refused_with_the_reason():
    def body(coll, r):
        errors = []
        for fn in (lambda: coll.all_gather(torch.zeros(4, 32, dtype=torch.float64), QuantConfig()),
                   lambda: coll.reduce_scatter(torch.zeros(3, 32), QuantConfig()),
                   lambda: coll.all_reduce(torch.zeros(4, 32), QuantConfig(), "three_shot"),
                   lambda: coll.all_gather(torch.tensor(1.0), QuantConfig()),
                   lambda: coll.all_gather(torch.zeros(4, 33), QuantConfig(32, pad=False))):
            try:
                fn()
            except (TypeError, ValueError) as e:
                errors.append(str(e))
        return errors

    got, _ = taco_jobs.simulate(2, body)
    errors = got[0]
    assert len(errors) == 5, errors
    assert "float64" in errors[0] and "divisible by the world size 2" in errors[1]
    assert "algorithm" in errors[2] and "at least one dimension" in errors[3] and "pad=False" in errors[4]

    backend = device.DeviceBackend()
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        backend.all_gather(torch.zeros(4, 32), QuantConfig())
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        backend.all_reduce(torch.zeros(4, 32), QuantConfig(), "one_shot")


def test_the_device_backend_is_made_when_first_asked_for():
    """No registration by import: importing the collectives (or the quantizer) imports neither the
    device backend nor the kernels; the first call naming "device" makes it."""
    import subprocess

    code = ("import sys, commweave.taco.collectives, commweave.taco.tp, commweave.taco.selector; "
            "print(sorted(m for m in ('commweave.taco.device', 'commweave.taco.cuda', 'commweave.taco.kernels') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.stdout.strip() == "[]", out.stdout
    assert isinstance(cc._backend("device"), device.DeviceBackend) and cc._backend("device") is cc._backend("device")


class _FakeContext:
    def __init__(self, group, is_cuda=True, device=torch.device("cuda", 0)):
        self.group, self.is_cuda, self.device = group, is_cuda, device


def test_the_device_backend_takes_the_context_of_the_calls_group(monkeypatch):
    """A call over a subgroup runs in runtime.default's context for that group (one per group), the
    default group's in the plain default context; a given context must be the call's group's."""
    import torch.distributed as dist

    pg = dist.ProcessGroup(dist.HashStore(), 0, 1)  # a group of its own: only its identity is used here
    asked = []

    def default_context(dev, **kw):
        asked.append((dev, kw))
        return _FakeContext(kw.get("group"))

    monkeypatch.setattr(device, "default_context", default_context)
    cuda0 = torch.device("cuda", 0)
    backend = device.DeviceBackend()
    assert backend.context(cuda0, pg).group is pg and backend.context(cuda0).group is None
    assert asked == [(cuda0, {"group": pg}), (cuda0, {})]
    assert device.DeviceBackend(_FakeContext(pg)).context(cuda0, pg).group is pg
    with pytest.raises(ValueError, match="not the one of the context this backend was given"):
        device.DeviceBackend(_FakeContext(None)).context(cuda0, pg)
    with pytest.raises(ValueError, match="needs a CUDA RankContext"):
        device.DeviceBackend(_FakeContext(None, is_cuda=False, device=torch.device("cpu"))).context(cuda0)
    with pytest.raises(ValueError, match="the context on cuda:0"):
        device.DeviceBackend(_FakeContext(None)).context(torch.device("cuda", 1))


# -- GPU ------------------------------------------------------------------------------------------

def _gpu_pool(world: int) -> WorkerPool:
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, this machine has {torch.cuda.device_count()}")
    env = {"PYTHONPATH": os.pathsep.join([str(TESTS), *sys.path])}
    return WorkerPool(world, device="cuda", job_timeout_s=600, env=env)


def _ok(result):
    assert result.ok, result.first_failure().traceback if result.first_failure() else result.status
    return result.values


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_device_backend_on_gpus_equals_the_reference_over_nccl(world):
    with _gpu_pool(world) as pool:
        for double_buffer, fuse in ((False, False), (True, False), (False, True), (True, True)):
            for value in _ok(pool.run("taco_jobs:device_vs_reference_gpu", cases=CASES, double_buffer=double_buffer,
                                      fuse_barriers=fuse)):
                assert value["mismatches"] == [], (double_buffer, fuse, value["mismatches"])


@pytest.mark.gpu
@pytest.mark.parametrize("double_buffer", [False, True], ids=["single", "double"])
def test_cuda_codec_for_simulated_ranks_on_one_gpu_equals_the_reference(reference, double_buffer):
    """W = 1, 2, 4 ranks as threads on one GPU (peers' buffers in its memory, barriers through the
    host): the CUDA kernels and the launches replayed after each layout's first calls equal the
    reference backend bit for bit, every case twice over."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    world, expected = reference
    got = taco_jobs.simulated_ranks_on_one_gpu(CASES, world, double_buffer)
    for rank in range(world):
        for n, results in enumerate(got[rank]["passes"]):
            for i, case in enumerate(CASES):
                assert taco_jobs.same_bits(results[i], expected[rank][i]), (rank, n, i, case)
        assert world == 1 or got[rank]["replayable"] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2, 4])
def test_device_backend_captured_in_a_cuda_graph_equals_the_reference(world):
    """Captured after eager calls, replayed with fresh inputs: every op (queued and fused barriers)
    equals the reference over NCCL bit for bit, replay after replay."""
    cases = CASES[:12]  # every op, ragged sizes, repeats
    with _gpu_pool(world) as pool:
        for fuse in (False, True):
            for value in _ok(pool.run("taco_jobs:device_in_cuda_graph_gpu", cases=cases, fuse_barriers=fuse)):
                assert value["mismatches"] == [], (fuse, value["mismatches"])
                assert value["replays"] == 3 * len(cases)
                assert value["fresh_layout_refused"]  # its windows cannot be allocated under capture


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2, 4])
def test_tp_layers_forward_and_backward_captured_in_a_cuda_graph(world):
    """TACO's sequence-parallel MLP (device backend, compressed both ways) captured forward and
    backward after eager steps: every replay with fresh inputs equals an eager step bit for bit."""
    with _gpu_pool(world) as pool:
        for value in _ok(pool.run("taco_jobs:tp_mlp_in_cuda_graph_gpu")):
            assert value["mismatches"] == [] and value["replays"] == 3, value


@pytest.mark.gpu
def test_device_backend_on_one_gpu():
    """One rank: every op equals the reference bit for bit, call after call (a reduce-scatter's sum
    is its own exact part alone), single- and double-buffered, queued and fused barriers."""
    with _gpu_pool(1) as pool:
        for double_buffer, fuse in ((False, False), (True, False), (True, True)):
            value = _ok(pool.run("taco_jobs:device_vs_reference_gpu", cases=CASES, double_buffer=double_buffer,
                                 fuse_barriers=fuse))[0]
            assert value["mismatches"] == [], value["mismatches"]


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_device_backend_bandwidth_against_nccl(world):
    """Printed (run with -s): algorithm bandwidth at 16 and 256 MiB of BF16, device backend (CUDA and
    Triton codecs) vs NCCL; the CUDA codec must beat the Triton one (bench/taco_bandwidth.py: the
    full sweep)."""
    with _gpu_pool(world) as pool:
        rows = _ok(pool.run("commweave.taco.bandwidth:measure", mibs=(16, 256), codecs=("cuda", "triton")))[0]
    print()
    for r in rows:
        print(f"taco-device world={r['world']} {r['op']:20} {r['mib']:4} MiB bf16 E4M3 G=128: NCCL {r['nccl_ms']:.3f} ms "
              f"{r['nccl_GBps']:.0f} GB/s | cuda {r['cuda_ms']:.3f} ms x{r['cuda_speedup']:.2f} | "
              f"triton {r['triton_ms']:.3f} ms x{r['triton_speedup']:.2f}")
    assert all(r["cuda_ms"] < r["triton_ms"] for r in rows if r["mib"] >= 256), rows


def test_triton_kernel_codec_in_the_algorithms_equals_the_reference_codec():
    """The algorithms with the fused kernels (Triton's interpreter, in a spawned child that imported
    Triton with TRITON_INTERPRET=1, as tests/test_taco_kernels.py does) give the reference codec's
    bits: decompress_into a slice of the output, accumulate from packed views, compress_into segments."""
    pytest.importorskip("triton")
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"  # inherited by the child at spawn, then restored here
    try:
        pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        future = pool.submit(taco_jobs.kernel_codec_vs_reference_codec, 2, CASES[:5])
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old
    try:
        assert future.result(timeout=300) == []
    finally:
        pool.shutdown()
