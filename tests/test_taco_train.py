"""bench/taco_train.py (issue 5's training check) on a 2-rank CPU pool with the tiny preset: the
data is deterministic and split disjointly, the TP/SP model with compression off equals a
single-process reference model trained on the same batches, and compression on stays close to off.

GPU (`PYTHONPATH=src:tests pytest -m gpu tests/test_taco_train.py -s`): a short run on 4 GPUs (2 if
that is all there is), reference and device backends."""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import taco_train  # noqa: E402  (bench/ is not a package: the workers import it by this name too)

from commweave.runtime import WorkerPool  # noqa: E402

MAX_BYTES = 2_000_000  # the first ~150 stdlib files: enough for the tiny runs, quick to read
TINY = ["--tiny", "--max-bytes", str(MAX_BYTES)]


def _ok(result):
    assert result.ok, result.first_failure().traceback if result.first_failure() else result.status
    return result.values


def test_data_is_deterministic_and_the_split_disjoint():
    files = taco_train.stdlib_files()
    assert len(files) > 100 and files == taco_train.stdlib_files()
    assert not any("site-packages" in p.parts for p in files)
    taco_train.load_corpus.cache_clear()
    a = taco_train.load_corpus(MAX_BYTES)
    taco_train.load_corpus.cache_clear()
    b = taco_train.load_corpus(MAX_BYTES)
    assert a is not b and torch.equal(a.train, b.train) and torch.equal(a.val, b.val)
    assert a.fingerprint == b.fingerprint and a.train_files == b.train_files
    assert set(a.train_files).isdisjoint(a.val_files) and a.val_files
    base = Path(os.path.dirname(os.__file__))
    read = [p.relative_to(base).as_posix() for p in files[:len(a.train_files) + len(a.val_files)]]
    assert sorted(a.train_files + a.val_files) == sorted(read)  # a prefix of the sorted file list
    assert a.val_files == tuple(read[i] for i in range(19, len(read), 20))
    assert a.train.numel() >= 0.9 * MAX_BYTES and a.val.numel() > 0
    # batches: a function of (seed, step) only, the right shape, tokens of the train stream
    w0 = taco_train.train_batch(a, 0, 4, 64, seed=1)
    assert w0.shape == (65, 4) and w0.dtype == torch.int64 and int(w0.max()) < taco_train.VOCAB
    assert torch.equal(w0, taco_train.train_batch(b, 0, 4, 64, seed=1))
    assert not torch.equal(w0, taco_train.train_batch(a, 1, 4, 64, seed=1))
    assert not torch.equal(w0, taco_train.train_batch(a, 0, 4, 64, seed=2))
    vals = taco_train.val_batches(a, 3, 4, 64)
    assert len(vals) == 3 and all(v.shape == (65, 4) for v in vals)
    val_text = bytes(a.val.tolist())
    assert bytes(vals[-1][:, -1].tolist()) in val_text


def test_schedule_and_eval_points():
    tc = taco_train.TrainConfig(steps=10, warmup=2, lr=1.0, eval_points=4)
    assert taco_train.eval_steps(tc) == [1, 4, 7, 9]
    assert taco_train.lr_at(0, tc) == 0.5 and taco_train.lr_at(1, tc) == 1.0
    assert math.isclose(taco_train.lr_at(10, tc), tc.min_lr_ratio)


@pytest.fixture(scope="module")
def pool():
    env = {"PYTHONPATH": os.pathsep.join([str(BENCH), *sys.path])}
    with WorkerPool(2, device="cpu", job_timeout_s=120, env=env) as p:
        yield p


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_tp_model_without_compression_equals_the_single_process_reference(pool, tied):
    """Same full weights, same batches: the TP/SP loss equals the reference's at step 0 and after
    optimizer steps (so the sequence-parallel gradient sums and the global grad norm are right)."""
    model = asdict(taco_train.ModelConfig(layers=2, hidden=64, heads=4, seq=64, tied=tied))
    train = asdict(taco_train.TrainConfig(steps=3, batch=4, lr=3e-3, warmup=1, max_bytes=MAX_BYTES))
    values = _ok(pool.run("taco_train:train_job", model=model, train=train, compress=False, reference_steps=3))
    tp, ref = values[0]["loss"], values[0]["reference_loss"]
    assert values[1]["loss"] == tp  # every rank reports the same all-reduced loss
    assert 5.0 < ref[0] < 6.0  # about ln(256) from the random init
    assert abs(tp[0] - ref[0]) <= 1e-5 * ref[0], (tp, ref)
    assert all(abs(t - r) <= 1e-4 * r for t, r in zip(tp, ref)), (tp, ref)
    assert ref[2] < ref[0]


def test_tiny_run_both_modes_cli(tmp_path):
    """The script end to end (CLI, pool, both modes, results JSON, PNG) on 2 CPU ranks."""
    out = taco_train.main(["--cpu-ranks", "2", *TINY, "--steps", "8", "--out-dir", str(tmp_path)])
    record = json.loads(Path(out["results"]).read_text())
    assert record["name"] == "taco-train-2cpu-2x64" and Path(out["plot"]).stat().st_size > 10_000
    assert record["config"]["model"]["layers"] == 2 and record["config"]["train"]["steps"] == 8
    assert record["config"]["dtype"] == "float32" and record["data"]["fingerprint"]
    plain, taco = record["plain"]["loss"], record["taco"]["loss"]
    assert len(plain) == len(taco) == 8 and all(math.isfinite(x) for x in plain + taco)
    for run in (plain, taco):
        assert sum(run[-3:]) / 3 < run[0] - 0.3  # it learns from the first steps
    # step 0: same weights and batch, only the compressed forward collectives differ
    assert plain[0] != taco[0] and abs(plain[0] - taco[0]) < 1e-3 * plain[0]
    assert all(abs(p - t) < 0.02 * p for p, t in zip(plain, taco)), (plain, taco)
    summary = record["summary"]
    assert set(record["plain"]["val_loss"]) == {"1", "3", "5", "7"}
    assert summary["final_val_rel_diff"] < 0.02
    assert all(v > 0 for v in summary["median_step_s"].values())


def test_graph_needs_the_device_backend():
    for argv in (["--cpu-ranks", "2", "--tiny", "--graph"], ["--gpus", "2", "--graph"]):
        with pytest.raises(SystemExit):
            taco_train.parse_args(argv)
    assert taco_train.parse_args(["--gpus", "2", "--backend", "device", "--graph"]).graph


def _train_on_one_gpu(graph: bool, compress: bool) -> dict:
    model = asdict(taco_train.ModelConfig(layers=2, hidden=256, heads=4, seq=256))
    train = asdict(taco_train.TrainConfig(steps=12, batch=4, lr=1e-3, warmup=3, max_bytes=MAX_BYTES))
    env = {"PYTHONPATH": os.pathsep.join([str(BENCH), *sys.path])}
    with WorkerPool(1, device="cuda", job_timeout_s=600, env=env) as pool:
        return _ok(pool.run("taco_train:train_job", model=model, train=train, compress=compress, backend="device",
                            dtype="bfloat16", graph=graph))[0]


@pytest.mark.gpu
@pytest.mark.parametrize("compress", [False, True], ids=["plain", "taco"])
def test_graph_steps_train_as_eager_steps_do(compress):
    """One GPU: the same 12 steps eagerly and as CUDA graph replays after 3 eager ones (capturable
    AdamW, a tensor learning rate): the losses agree (the optimizer's capturable form rounds a
    little differently), every step is real (none repeated, none skipped)."""
    if torch.cuda.device_count() < 1:
        pytest.skip("needs a CUDA GPU")
    eager, captured = _train_on_one_gpu(False, compress), _train_on_one_gpu(True, compress)
    assert len(captured["loss"]) == len(eager["loss"]) == 12
    assert captured["loss"][:taco_train.GRAPH_WARMUP] == pytest.approx(eager["loss"][:taco_train.GRAPH_WARMUP], rel=1e-3)
    assert captured["loss"] == pytest.approx(eager["loss"], rel=2e-2)
    assert captured["loss"][-1] < captured["loss"][0] - 0.5  # it learns


@pytest.mark.gpu
@pytest.mark.parametrize("backend,batch", [("reference", 4), ("device", 4)])
def test_short_training_check_on_gpus(tmp_path, backend, batch):
    """A short run on 4 GPUs (or 2): BF16, both modes finite, learning and close; prints the summary."""
    gpus = 4 if torch.cuda.device_count() >= 4 else 2
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    out = taco_train.main(["--gpus", str(gpus), "--backend", backend, "--steps", "40",
                           "--layers", "2", "--hidden", "512", "--heads", "8", "--seq", "512", "--batch", str(batch),
                           "--lr", "1e-3", "--max-bytes", "8000000", "--out-dir", str(tmp_path)])
    record = json.loads(Path(out["results"]).read_text())
    plain, taco = record["plain"]["loss"], record["taco"]["loss"]
    assert all(math.isfinite(x) for x in plain + taco)
    assert plain[-1] < plain[0] - 1.0 and taco[-1] < taco[0] - 1.0
    assert record["summary"]["final_val_rel_diff"] < 0.02, record["summary"]
