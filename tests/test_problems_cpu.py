"""Problems (commweave.problems): the format, values, binding, and the judge on CPU (gloo, 2 ranks).

The problem files are our own, under tests/problems/: one in commweave's format, and a stand-in
ParallelKernelBench checkout (tests/problems/pkb) in PKB's layout and calling convention."""

from __future__ import annotations

import dataclasses
import json
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

import commweave.problems.workload as problem_workload
from commweave.agents.problem_binding import Binding, Unbound, bind_trace
from commweave.cli import app
from commweave.contracts.workload import Shape
from commweave.problems.format import ProblemError, load_problem, problems_in
from commweave.problems.judge import VARYING, Unsupported, host_bound, judge, probe
from commweave.problems.program import Bound
from commweave.problems.values import (
    ARGS, GroupLeaf, TensorLeaf, constant_key, flatten_args, flatten_result, pack_pickled, rebuild_args,
    skeleton_bytes, skeleton_from_bytes, unpack_skeleton,
)
from commweave.problems.workload import reference_workers, workload_for
from commweave.runtime.pool import WorkerPool

HERE = Path(__file__).parent / "problems"
OWN = HERE / "allgather_matmul.py"
SOLUTIONS = HERE / "solutions"


def test_own_format_and_pkb_layout_are_read_in_place(tmp_path: Path) -> None:
    own = load_problem(OWN)
    assert (own.kind, own.world_sizes, own.tolerance) == ("file", (1, 2, 4), 1e-3)
    pkb = problems_in(HERE / "pkb", base_shape=(8, 4), dtype="float32")
    assert [(p.name, p.kind, p.problem_id, p.base_shape) for p in pkb] == [("3_scaled_allreduce", "pkb", 3, (8, 4)),
                                                                         ("16_matmul_reducescatter", "pkb", 16, (8, 4))]
    bad = tmp_path / "bad.py"
    bad.write_text("def make_inputs(rank, world_size, seed, device):\n    return ()\n")
    with pytest.raises(ProblemError, match="defines no solution"):
        load_problem(bad)
    with pytest.raises(ProblemError, match="--shape applies to ParallelKernelBench"):
        load_problem(OWN, base_shape=(2, 2))


def test_arguments_travel_as_tensors_and_a_skeleton() -> None:
    group = object()
    args = (torch.ones(2, 3), [torch.arange(4), 5], {"eps": 1e-5}, None)
    tensors, skeleton = flatten_args(args, lambda g: 0)
    assert sorted(tensors) == ["t0", "t1"]
    packed = pack_pickled(skeleton_bytes((skeleton, [])), 4096)
    back, order = unpack_skeleton(packed)
    rebuilt = rebuild_args(back, tensors, lambda index: group)
    assert torch.equal(rebuilt[0], args[0]) and torch.equal(rebuilt[1][0], args[1][0])
    assert rebuilt[1][1] == 5 and rebuilt[2] == {"eps": 1e-5} and rebuilt[3] is None and order == []
    assert rebuild_args((GroupLeaf(None),), {}, lambda index: (group, index)) == ((group, None),)
    flat = flatten_result((torch.tensor([[1.0, 2.0]]), {"b": 3, "a": torch.tensor([4])}, None))
    assert flat.tolist() == [1.0, 2.0, 4.0, 3.0, 1.0]  # dicts by key, then the constant 1.0
    with pytest.raises(ValueError, match="a solution returns tensors"):
        flatten_result(("text",))


def test_a_module_argument_packs_to_the_same_bytes_wherever_its_weights_live() -> None:
    """PKB #31's nn.Linear arguments: torch pickles a storage by its address, so the same seed drawn
    twice read as 'input args was modified' once two draws were alive at once."""
    def draw() -> torch.nn.Linear:
        torch.manual_seed(3)
        return torch.nn.Linear(8, 4).to(torch.bfloat16)

    first, second = draw(), draw()  # both alive: different storages
    assert pickle.dumps(first) != pickle.dumps(second)  # what the judge must not compare
    assert torch.equal(pack_pickled(skeleton_bytes(first), 1 << 14), pack_pickled(skeleton_bytes(second), 1 << 14))
    back = unpack_skeleton(pack_pickled(skeleton_bytes((first, torch.zeros(0))), 1 << 14))
    assert isinstance(back[0].weight, torch.nn.Parameter) and back[0].weight.requires_grad
    assert torch.equal(back[0].weight, first.weight) and back[0].weight.dtype == torch.bfloat16
    assert back[1].shape == (0,)


def test_binding_recognises_known_patterns_and_says_why_not() -> None:
    """Ops as the tracer records them (name, tensor shapes, dtypes), at 2 ranks: a matmul binds
    only where shapes join it to the collective."""
    f32, fp8 = ["torch.float32"] * 3, ["torch.float8_e4m3fn"] * 3
    gather_a = ("c10d.allgather_.default", [(2, 6)] * 3, f32)  # two (2, 6) outputs, one input
    cat = ("aten.cat.default", [(2, 6), (2, 6)], f32)
    mm = ("aten.mm.default", [(4, 6), (6, 5)], f32)
    gather_c = ("c10d.allgather_.default", [(4, 5)] * 3, f32)
    rs = ("c10d._reduce_scatter_base_.default", [(2, 5), (4, 5)], f32)
    assert bind_trace([gather_a, cat, mm], 2) == Binding("gemm-allgather", "4x5x6", "all-gather -> matmul")
    assert bind_trace([mm, gather_c], 2) == Binding("gemm-allgather", "4x10x6", "matmul -> all-gather")
    assert bind_trace([mm, rs], 2).shape == "4x5x12"  # K is the matmul's local K times the ranks
    assert bind_trace([(gather_a[0], gather_a[1], fp8), mm], 2).workload == "gemm-allgather-lossy"
    a2a = ("c10d.alltoall_base_.default", [(8, 4), (8, 4)], f32)
    bmm = ("aten.bmm.default", [(2, 4, 4), (2, 4, 3)], f32)
    assert bind_trace([a2a, bmm, a2a], 2).workload == "moe"
    softmax = ("aten._softmax.default", [(2, 4, 4)], f32)
    send, recv = ("c10d.send.default", [(4, 4)], f32), ("c10d.recv_.default", [(4, 4)], f32)
    assert bind_trace([send, recv, softmax, send, recv], 2).workload == "attention-cp"
    with pytest.raises(Unbound, match="it runs allgather_ and matmuls not joined to them"):
        bind_trace([("c10d.allgather_.default", [(3, 3)] * 3, f32), mm], 2)  # gathers something else
    with pytest.raises(Unbound, match="all-to-all around expert matmuls"):
        bind_trace([a2a, softmax, bmm, a2a], 2)  # attention between all-to-alls (Ulysses) is no MoE
    with pytest.raises(Unbound, match="it runs allreduce_, no matmul"):
        bind_trace([("c10d.allreduce_.default", [(4,)], f32)], 2)


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(2, "cpu", job_timeout_s=300) as p:
        yield p


def test_a_solution_that_makes_its_groups_on_every_call_gets_the_first_ones(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """1 CPU rank (gloo): dist.new_group(ranks) inside a solution returns the group first made for
    those ranks (PKB #48 makes two per call: with NCCL a few hundred calls exhausted the GPU), and
    the input maker's groups come from the same place; with options it is made anew."""
    import tempfile

    import torch.distributed as dist

    monkeypatch.setattr(dist, "new_group", dist.new_group)  # restored after the test
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # Bound's copy of the source
    source = ("import torch\nimport torch.distributed as dist\n"
              "def solution(x):\n"
              "    a, b = dist.new_group([0]), dist.new_group([0])\n"
              "    return torch.stack([x.sum(), torch.tensor(float(a is b))])\n")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        bound = Bound(source, SimpleNamespace(rank=0), Shape("any"))
        assert bound.constant is None
        first = bound.solution(torch.ones(3))
        again = bound.solution(torch.ones(3))
        assert first.tolist() == [3.0, 1.0] and again.tolist() == [3.0, 1.0]
        assert len(bound.groups) == 1 and bound._group([(0,)], 0) is bound.groups[(0,)]
        assert dist.new_group([0], timeout=None) is not bound.groups[(0,)]
    finally:
        dist.destroy_process_group()


def test_a_constant_skeleton_comes_in_the_shape_and_is_never_read_back(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """No ranks: where the probe saw a rank's arguments constant, the program gets them once, in
    the shape, and never reads the `args` input (on a GPU that read waits for the judge's hold
    and stalled every batch). The input here is on the meta device, which cannot be read."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # Bound's copy of the source
    skeleton = ((TensorLeaf("t0", False), 2.0), [])
    source = "def solution(x, scale):\n    return x * scale\n"
    inputs = {"t0": torch.ones(3), ARGS: torch.empty(64, dtype=torch.uint8, device="meta")}
    out = torch.empty(4)
    shape = Shape("any", {constant_key(0): skeleton_bytes(skeleton).hex(), constant_key(1): "00"})
    Bound(source, SimpleNamespace(rank=0), shape).run(inputs, out)
    assert out.tolist() == [2.0, 2.0, 2.0, 1.0]
    with pytest.raises(NotImplementedError):  # no constant for this rank: read back from the input
        Bound(source, SimpleNamespace(rank=2), shape).run(inputs, out)


def test_a_call_gets_the_judges_own_input_tensors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No ranks: the wrapper copies no input (a copy per tensor per call is timed with the program
    and dilutes every ratio at PKB's sizes); an argument that asks for gradients is a leaf of its
    own over the same memory, so the judge's tensor is left as it was."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    skeleton = ((TensorLeaf("t0", False), TensorLeaf("t1", True)), [])
    source = "def solution(x, w):\n    assert w.requires_grad and w.is_leaf\n    x.mul_(3)\n    return x + w.detach()\n"
    inputs = {"t0": torch.ones(3), "t1": torch.full((3,), 0.5)}
    out = torch.empty(4)  # the result's elements, then 1.0
    Bound(source, SimpleNamespace(rank=0), Shape("any", {constant_key(0): skeleton_bytes(skeleton).hex()})).run(inputs, out)
    assert out.tolist() == [3.5] * 3 + [1.0] and inputs["t0"].tolist() == [3.0] * 3  # written in place: no copy
    assert not inputs["t1"].requires_grad


def test_the_probe_marks_constant_arguments_and_a_change_is_judged_again(pool: WorkerPool) -> None:
    """2 CPU ranks: our problem's arguments never change with the seed, so the probe gives each
    rank's skeleton (a ragged problem's it does not, below). When a draw differs from
    what the probe saw (here a skeleton the problem never draws), the judge judges again reading
    every call's arguments from its inputs, and the verdict is the same."""
    problem = load_problem(OWN)
    layout = probe(pool, problem)
    assert all(layout.constant)
    (a, b), order = skeleton_from_bytes(bytes.fromhex(layout.constant[0]))
    swapped = skeleton_bytes(((b, a), order)).hex()
    verdict = judge(pool, problem, OWN.read_text(), trials=2, warmup=1, iters=3,
                    layout=dataclasses.replace(layout, constant=(swapped, swapped)))
    assert verdict.ok, verdict.failure


def test_a_batch_draws_its_inputs_in_one_request(pool: WorkerPool, monkeypatch: pytest.MonkeyPatch) -> None:
    """2 CPU ranks (this process's reference workers): the seeds of a judge's batch go to the
    workers as one request, not one round trip each, and every draw is the one made alone; a
    batch larger than PREFETCH_BYTES takes several requests (so the judge holds only so much)."""
    problem = load_problem(OWN)
    workload = workload_for(problem, probe(pool, problem))
    cpu, seeds = torch.device("cpu"), [5, 6, 7]
    workers = reference_workers(problem, 2, "cpu")
    try:
        alone = [workload.make_inputs(workload.shape, 2, 1, seed, cpu) for seed in seeds]
        asked: list[str] = []
        request = workers.request
        monkeypatch.setattr(workers, "request", lambda op, arg, rank: asked.append(op) or request(op, arg, rank))
        workload.prepare_inputs(workload.shape, 2, 1, seeds, cpu)
        together = [workload.make_inputs(workload.shape, 2, 1, seed, cpu) for seed in seeds]
        assert asked == ["inputs"]
        for one, other in zip(alone, together):
            assert one.keys() == other.keys() and all(torch.equal(one[k], other[k]) for k in one)
        elements = sum(t.numel() for name, t in alone[0].items() if name != ARGS)
        monkeypatch.setattr(problem_workload, "PREFETCH_BYTES", 2 * 8 * elements + 2)  # two draws held at once
        asked.clear()
        workload.prepare_inputs(workload.shape, 2, 1, seeds, cpu)
        again = [workload.make_inputs(workload.shape, 2, 1, seed, cpu) for seed in seeds]
        assert asked == ["inputs", "inputs"] and all(torch.equal(a["t0"], b["t0"]) for a, b in zip(alone, again))
    finally:
        workers.close()


def test_a_requests_draws_travel_in_one_buffer_and_come_back_equal() -> None:
    """No ranks. Every dense tensor of a request's draws (any dtype, 0-d, one asking for gradients)
    is packed into one buffer, each aligned, and read back equal as a view of it; a sparse and an
    empty tensor travel by value beside it."""
    from commweave.problems.service import _packed, unpacked
    from commweave.runtime.shared_buffers import ALIGN

    gen = torch.Generator().manual_seed(3)
    first = {"a": torch.randn(3, 5, generator=gen), "b": torch.arange(7, dtype=torch.int64),
             "c": torch.randn(4, generator=gen).to(torch.bfloat16), "d": torch.tensor(2.5, requires_grad=True)}
    second = {"a": torch.rand(3, 5, generator=gen) > 0.5, "e": torch.randn(2, 3, generator=gen).t(),
              "s": torch.eye(3).to_sparse(), "z": torch.empty(0, 4)}
    buffer, slots, travel = _packed([(first, "skeleton 1"), (second, "skeleton 2")], torch.device("cpu"), False)
    assert buffer.dtype == torch.uint8 and all(slot.offset % ALIGN == 0 for slot in slots)
    back = unpacked(buffer, slots, travel)
    assert [rest for _, rest in back] == ["skeleton 1", "skeleton 2"]
    for made, (tensors, _) in zip((first, second), back):
        assert list(tensors) == list(made)
        for name, tensor in made.items():
            came = tensors[name]
            in_buffer = came.layout == torch.strided and came.numel() > 0 and \
                came.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
            assert in_buffer == (name not in ("s", "z")), name
            assert came.dtype == tensor.dtype and came.shape == tensor.shape and not came.requires_grad
            assert torch.equal(came.to_dense(), tensor.detach().to_dense())


def test_only_the_workload_in_use_holds_draws_and_results(pool: WorkerPool) -> None:
    """2 CPU ranks' reference workers. Judges keep every workload they built; once the judge uses
    another, the first lets go of its prefetched draws and cached reference results (on GPUs they
    are the reference workers' memory, freed only when the judge lets go)."""
    problem = load_problem(OWN)
    layout = probe(pool, problem)
    first = workload_for(problem, layout)
    second = workload_for(problem, dataclasses.replace(layout, fixed=not layout.fixed))
    cpu = torch.device("cpu")
    try:
        first.prepare_inputs(first.shape, 2, 1, [5, 6, 7], cpu)
        first.make_inputs(first.shape, 2, 1, 5, cpu)
        first.reference(first.shape, 2, 1, 5, cpu)
        assert len(first._drawn[1]) == 2 and len(first._results) == 1
        second.reference(second.shape, 2, 1, 5, cpu)
        assert not first._drawn and not first._results and len(second._results) == 1
    finally:
        reference_workers(problem, 2, "cpu").close()


def test_judge_tells_right_wrong_stale_and_slow_apart(pool: WorkerPool) -> None:
    """2 CPU ranks (gloo). The reference against itself is correct at about 1x; a wrong solution and
    one returning another trial's output fail; one doing the work twice is correct and slower."""
    problem = load_problem(OWN)
    layout = probe(pool, problem)
    assert layout.fixed and layout.out == (256 * 256 + 1,) * 2
    itself = judge(pool, problem, OWN.read_text(), warmup=4, iters=15, layout=layout)
    assert itself.ok and 0.7 < itself.speedup < 1.4, itself
    for name in ("wrong", "stale"):
        verdict = judge(pool, problem, (SOLUTIONS / f"{name}.py").read_text(), layout=layout)
        assert not verdict.ok and verdict.failure.startswith("wrong_result"), (name, verdict)
    slow = judge(pool, problem, (SOLUTIONS / "slow.py").read_text(), warmup=4, iters=15, layout=layout)
    assert slow.ok and slow.speedup < 0.8, slow


RAGGED = ("import torch\nimport torch.distributed as dist\n\n\n"
          "def make_inputs(rank, world_size, seed, device):\n"
          "    gen = torch.Generator().manual_seed(seed * 7 + rank)\n"
          "    n = int(torch.randint(5, 500, (1,), generator=gen))\n"
          "    return (torch.ones(4), torch.randn(n, generator=gen).to(device))\n\n\n"
          "def solution(scale, values):\n"
          "    total = values.sum().reshape(1) * scale\n"
          "    dist.all_reduce(total)\n"
          "    return total\n")


def test_inputs_whose_shape_varies_with_the_seed_are_judged(pool: WorkerPool, tmp_path: Path) -> None:
    """2 CPU ranks: PKB #70 draws a values tensor as long as the sum of random lengths. The judge's
    buffers have one size per tensor, so such a tensor travels by value inside the skeleton (the
    probe leaves room for twice its larger draw): the reference judges itself correct, and a
    solution that drops the last value is caught."""
    ragged = tmp_path / "ragged_sum.py"
    ragged.write_text(RAGGED)
    problem = load_problem(ragged)
    layout = probe(pool, problem)
    assert not any(layout.constant)  # each call reads its arguments from its inputs
    own = judge(pool, problem, RAGGED, trials=3, warmup=1, iters=3, layout=layout)
    assert own.ok, own.failure
    dropped = RAGGED.replace("values.sum()", "values[:-1].sum()")
    wrong = judge(pool, problem, dropped, trials=3, warmup=1, iters=3, layout=layout)
    assert not wrong.ok and wrong.failure.startswith("wrong_result"), wrong


def test_an_input_shape_the_probe_did_not_draw_travels_by_value(pool: WorkerPool) -> None:
    """2 CPU ranks: PKB #85 leaves rank 1's tensor empty for 1 seed in 4, which the probe's two
    seeds may miss; the judge then meets the other shape while judging. Here the probe is told a
    shape no seed draws: the tensor travels in the skeleton and the reference still judges itself
    correct; with no room left in the skeleton, the verdict names the tensor in one line."""
    problem = load_problem(OWN)
    layout = probe(pool, problem)
    (name, shape), *rest = layout.inputs[1]
    wrong = dataclasses.replace(layout, inputs=(layout.inputs[0], ((name, (shape[0] + 1, *shape[1:])), *rest)),
                                args=(layout.args[0], 1 << 20),  # room for its 256 KiB by value
                                constant=("", ""))  # as the probe leaves them when a shape varies
    verdict = judge(pool, problem, OWN.read_text(), trials=2, warmup=1, iters=2, layout=wrong)
    assert verdict.ok, verdict.failure
    cramped = dataclasses.replace(wrong, args=layout.args)  # 4 KiB past the skeleton: too little
    with pytest.raises(Unsupported, match=rf"rank 1's input tensor {name} .* changes shape with the seed") as caught:
        judge(pool, problem, OWN.read_text(), trials=2, warmup=1, iters=2, layout=cramped)
    assert caught.value.cause == VARYING


def test_pkb_layout_with_a_group_and_a_scalar_through_the_cli() -> None:
    """2 CPU ranks: a PKB-style problem whose arguments hold a scalar and a process group; --json
    prints the issue's fields and exits 0 on a verdict, 2 with one line on a bad file."""
    ref = HERE / "pkb" / "reference" / "3_scaled_allreduce.py"
    runner = CliRunner()
    result = runner.invoke(app, ["judge", str(ref), str(ref), "--gpus", "2", "--device", "cpu", "--shape", "64x32",
                                 "--dtype", "float32", "--trials", "2", "--iters", "5", "--warmup", "1", "--json"])
    assert result.exit_code == 0, result.output
    fields = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(fields) == {"ok", "failure", "speedup", "reference_us", "solution_us", "trials", "world_size"}
    assert fields["ok"] and fields["world_size"] == 2 and fields["trials"] == 2
    missing = runner.invoke(app, ["judge", str(ref), str(HERE / "nope.py"), "--device", "cpu"])
    assert missing.exit_code == 2 and "nope.py: no such file" in missing.output


def test_a_solution_working_in_place_on_its_arguments_is_judged_correct() -> None:
    """2 CPU ranks: PKB solutions all-reduce their arguments in place. The judge hands a call its
    own input set (no copy inside the timed region) and does not fail a problem's program for
    writing to it; the output still has to match the reference drawn from the seed."""
    problem = load_problem(HERE / "pkb" / "reference" / "3_scaled_allreduce.py", base_shape=(64, 32), dtype="float32")
    in_place = ("import torch.distributed as dist\n\n\ndef solution(x, scale, group):\n"
                "    x.mul_(scale)\n    dist.all_reduce(x, group=group)\n    return x\n")
    with WorkerPool(2, "cpu", job_timeout_s=120) as pool:
        layout = probe(pool, problem)
        right = judge(pool, problem, in_place, trials=2, warmup=1, iters=5, layout=layout)
        wrong = judge(pool, problem, in_place.replace("x.mul_(scale)\n", "x.mul_(scale)\n    x.add_(1)\n"), trials=2,
                      warmup=1, iters=5, layout=layout)
    assert right.ok, right
    assert not wrong.ok and wrong.failure.startswith("wrong_result"), wrong


def test_problems_run_keeps_what_it_judged_when_stopped_midway(tmp_path: Path, monkeypatch) -> None:
    """No ranks: `problems run` rewrites its JSON and HTML after every problem, so a run stopped
    after the first of two (here: the second raises, as a deadline's SIGTERM would end it) leaves
    the first row on disk and names the other as not judged yet. `--only` keeps its order and
    names a number that matches no problem."""
    import commweave.problems.suite as suite

    def first_then_stopped(problems, world_size, device, solutions=None, *, progress=None, **options):
        progress(suite.Row(problems[0].name, problems[0].reference, "ok", True, 1.0, 10.0, 10.0, "", 1.0))
        raise KeyboardInterrupt

    monkeypatch.setattr(suite, "run_problems", first_then_stopped)
    result = CliRunner().invoke(app, ["problems", "run", str(HERE / "pkb"), "--device", "cpu", "--gpus", "2",
                                      "--only", "16,3", "--out-dir", str(tmp_path)])
    assert result.exit_code != 0
    [written] = tmp_path.glob("problems-pkb-cpu-*.json")
    table = json.loads(written.read_text())
    assert [r["problem"] for r in table["rows"]] == ["16_matmul_reducescatter"] and table["summary"]["ok"] == 1
    assert table["not_judged_yet"] == ["3_scaled_allreduce"], table
    assert written.with_suffix(".html").is_file()
    unknown = CliRunner().invoke(app, ["problems", "run", str(HERE / "pkb"), "--device", "cpu", "--only", "3,999",
                                       "--out-dir", str(tmp_path)])
    assert unknown.exit_code == 2 and "999 matches no problem" in " ".join(unknown.output.split()), unknown.output


def test_problems_run_writes_json_and_html_with_the_judges_resolution(tmp_path: Path) -> None:
    """2 CPU ranks: `problems run` on a PKB-layout folder writes the table as JSON (with provenance,
    into --out-dir) and HTML; each row carries the judge's resolution for both programs (calls per
    timed batch, and no batch the GPU ran before it was queued: `host_bound` names none)."""
    page = tmp_path / "table.html"
    result = CliRunner().invoke(app, ["problems", "run", str(HERE / "pkb"), "--gpus", "2", "--device", "cpu",
                                      "--shape", "64x32", "--dtype", "float32", "--only", "3", "--trials", "2",
                                      "--iters", "3", "--warmup", "1", "--out", str(page), "--out-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    bad = CliRunner().invoke(app, ["problems", "run", str(HERE / "pkb"), "--device", "cpu", "--out-dir", str(page)])
    assert bad.exit_code == 2 and "is a file, not a folder" in " ".join(bad.output.split()), bad.output
    (written,) = tmp_path.glob("problems-pkb-cpu-*.json")
    table = json.loads(written.read_text())
    assert table["commit"] and table["summary"]["ok"] == 1 and page.read_text().count("3_scaled_allreduce")
    (row,) = table["rows"]
    assert set(row["resolution"]) == {"reference", "solution"}
    assert all(r["batch"] >= 1 and r["hold_expired"] == 0 for r in row["resolution"].values())
    assert host_bound(row["resolution"]) == []
    assert host_bound({"reference": {"hold_expired": 0}, "solution": {"hold_expired": 2}}) == ["solution"]


def test_problems_bind_names_the_template_or_says_why_not() -> None:
    """Traced on 2 CPU ranks: all-gather -> matmul binds gemm-allgather at the traced size; an
    all-reduce alone binds nothing (one line, exit 2)."""
    runner = CliRunner()
    bound = runner.invoke(app, ["problems", "bind", str(OWN), "--gpus", "2", "--device", "cpu"])
    assert bound.exit_code == 0, bound.output
    assert "template gemm-allgather" in bound.output and "256x256x512" in bound.output.replace("\n", "")
    ref = HERE / "pkb" / "reference" / "3_scaled_allreduce.py"
    unbound = runner.invoke(app, ["problems", "bind", str(ref), "--gpus", "2", "--device", "cpu", "--shape", "8x4",
                                  "--dtype", "float32"])
    assert unbound.exit_code == 2 and "no known pattern" in unbound.output


def test_evolve_problem_dry_run_binds_and_searches_with_a_simulated_judge(tmp_path: Path) -> None:
    """2 CPU ranks trace each reference: all-gather -> matmul (our format) and matmul ->
    reduce-scatter (PKB layout) bind to their templates, and `evolve --problem --dry-run` runs the
    $0 search on them with no GPU; its run says simulated and resumes only as a dry run."""
    from commweave.search.driver import run_meta

    runner = CliRunner()
    cases = [([str(OWN)], "gemm-allgather", "256x256x512"),
             ([str(HERE / "pkb" / "reference" / "16_matmul_reducescatter.py")], "gemm-reducescatter", "1024x1024x2048")]
    for args, workload, shape in cases:
        runs = tmp_path / workload
        result = runner.invoke(app, ["evolve", "--problem", *args, "--dry-run", "--gpus", "2", "--budget", "12",
                                     "--runs-dir", str(runs)])
        assert result.exit_code == 0, result.output
        assert f"template {workload}" in result.output and "dry run: 12 evaluated" in result.output, result.output
        (path,) = runs.glob("*.sqlite")
        meta = run_meta(path)
        assert meta["simulated"] and meta["workload"] == workload and meta["gpus"] == 2, meta
        assert meta["shape"] == shape, meta["shape"]
    real = runner.invoke(app, ["evolve", "gemm-reducescatter", "--resume", str(path)])
    assert real.exit_code == 2 and "a dry run (simulated judge): resume it with --dry-run" in real.output
    llm = runner.invoke(app, ["evolve", "--problem", str(OWN), "--dry-run", "--llm", "openai:m"])
    assert llm.exit_code == 2 and "leave out --cluster, --pool-gpus and --llm" in llm.output
