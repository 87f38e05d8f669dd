"""The fast-path agent: static analysis, the two-stage rewrite with its judge, the template path
without an LLM, and `commweave agent fast-path`.

The LLM is real HTTP: `tests/llm_servers.py` runs local servers speaking OpenAI's chat-completions
and Anthropic's messages protocols, replaying scripted answers (`tests/fast_path_script/`), which
the official SDKs call. The cascade is the real Evaluator on gloo CPU workers.

What the CPU tests simulate: a CPU has no device-initiated communication, so the toy workload's
"stage B" scripts replace the collective all-gather by point-to-point isend/irecv into a buffer
allocated in setup (the host-side analogue of pushing shards into peers' windows), and the fast path
runs with `require_device_initiated=False` (its static check that no host collective remains is
tested on its own). The real conversion — examples/host_gemm_allgather.py to an LSA push kernel
through the same scripts' GEMM counterparts — is the `gpu` test at the end:

    python -m pytest -m gpu tests/test_agent_fast_path.py
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from commweave.agents import (
    AnalysisError, FastPath, FastPathError, analyze_program, analyze_source, attempt_log_path,
    conservative_directives, renderable_conservative,
)
from commweave.agents.prompts import JUDGE_SYSTEM
from commweave.cli import app
from commweave.evaluate import Evaluator
from commweave.contracts.program import parse_program
from commweave.llm import Ledger, client_for, extract_code
from commweave.runtime import WorkerPool
from commweave.space import directives_of, program_body
from commweave.workloads import get_workload
from llm_servers import Fail, Raw, Reply, ScriptedAnthropicServer, ScriptedOpenAIServer, Trickle
from toy_workload import ToyGatherMatmul
from worker_env import worker_env

TESTS = Path(__file__).parent
ROOT = TESTS.parent
SCRIPT = TESTS / "fast_path_script"
EXAMPLE = ROOT / "examples" / "host_gemm_allgather.py"
TOY_INPUT = TESTS / "programs_cpu" / "host.py"
TOY = ToyGatherMatmul()
PRICES = dict(input_usd_per_mtok=3.0, output_usd_per_mtok=15.0)
runner = CliRunner()


def script(workload: str, name: str) -> str:
    return (SCRIPT / workload / f"{name}.md").read_text()


def said(result) -> str:
    return " ".join(result.output.split())  # rich wraps long lines


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(2, device="cpu", job_timeout_s=60, env=worker_env()) as p:
        yield p


@pytest.fixture(scope="module")
def toy_evaluator(pool):
    return Evaluator(pool, TOY, warmup=1, iters=3)


def toy_agent(evaluator, srv, attempts: int = 3, budget: float | None = None, model: dict | None = None, **kw):
    """A fast path on the toy workload through `srv` (its model config overridden by `model`), and
    the list its ledger's records go to."""
    records = []
    client = client_for(srv.model(**(dict(timeout_s=10) | PRICES | (model or {}))),
                        Ledger(budget, on_call=records.append))
    agent = FastPath(TOY, evaluator, client, world_size=2, attempts=attempts,
                     require_device_initiated=kw.pop("require_device_initiated", False), **kw)
    return agent, records


# -- analysis -------------------------------------------------------------------------------------
def test_analysis_of_the_example_names_the_collective_its_buffers_and_line():
    report = analyze_program(EXAMPLE)
    assert report.language == "python" and report.functions == ["setup", "run"]
    (gather,) = report.collectives
    line = next(i for i, text in enumerate(EXAMPLE.read_text().splitlines(), 1) if "all_gather_into_tensor(" in text)
    assert (gather.name, gather.line, gather.function) == ("all_gather_into_tensor", line, "run")
    assert gather.buffers == ("state['a_full']", "inputs['a']") and gather.options == ("group=ctx.group",)
    assert not gather.is_async and not report.streams and not report.sync_points and not report.device
    section = report.render_prompt()
    assert f"line {line}, in run(): `all_gather_into_tensor`" in section and "blocking" in section


PYTHON_SOURCE = '''\
import torch
import torch.distributed as dist
from torch.distributed import all_reduce


def run(ctx, state, inputs, out):
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        work = dist.all_gather_into_tensor(state["full"], inputs["a"], group=ctx.group, async_op=True)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, inputs["a"], 1), dist.P2POp(dist.irecv, out, 1)])
    for req in reqs:
        req.wait()
    work.wait()
    all_reduce(out, op=dist.ReduceOp.SUM)
    torch.cuda.current_stream().wait_stream(side)
    done = torch.cuda.Event()
    done.record()
    torch.cuda.synchronize()
    dist.barrier()
    buf = ctx.symmetric((4,), torch.float32)
    gather = getattr(dist, "all_gather_single", None)
'''


def test_analysis_of_python_finds_async_handles_streams_and_sync_points():
    report = analyze_source(PYTHON_SOURCE, "python", "prog.py")
    assert [(c.name, c.line) for c in report.collectives] == [
        ("all_gather_into_tensor", 9), ("batch_isend_irecv", 10), ("P2POp", 10), ("P2POp", 10), ("all_reduce", 14),
        ("all_gather_single", 21)]
    by_name = {(c.name, c.line): c for c in report.collectives}
    gather = by_name[("all_gather_into_tensor", 9)]
    assert gather.is_async and gather.handle == "work" and gather.waited_at == (13,)
    batch = by_name[("batch_isend_irecv", 10)]
    assert batch.is_async and batch.handle == "reqs" and batch.waited_at == (12,)  # through the loop variable
    p2p = [c for c in report.collectives if c.name == "P2POp"]
    assert [c.buffers for c in p2p] == [("inputs['a']",), ("out",)] and all("peer=1" in c.options for c in p2p)
    assert by_name[("all_reduce", 14)].options == ("op=dist.ReduceOp.SUM",)  # `from torch.distributed import`
    assert by_name[("all_gather_single", 21)].indirect
    assert [(s.kind, s.line) for s in report.streams] == [("Stream", 7), ("with stream", 8), ("current_stream", 15)]
    assert [(s.kind, s.line) for s in report.sync_points] == [
        ("stream waits for stream", 15), ("event created", 16), ("event record", 17), ("device synchronize", 18),
        ("barrier (host, all ranks)", 19)]
    assert [(s.kind, s.line) for s in report.device] == [("ctx.symmetric", 20)]


CUDA_SOURCE = '''\
#include <nccl.h>
// ncclAllReduce(in, out, n, ncclFloat, ncclSum, comm, s);  a comment, not a call
int main() {
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  /* ncclSend(x, n, ncclFloat, 1, comm, s); */
  ncclGroupStart();
  ncclSend(send_buf, count, ncclBfloat16, peer, comm, s);
  ncclRecv(recv_buf + offset(peer, count), count, ncclBfloat16, peer, comm, s);
  ncclGroupEnd();
  ncclAllGather(a_shard, a_full, shard_elems, ncclBfloat16,
                comm, s);
  gemm<<<grid, block, 0, s>>>(a_full, b, c);
  cudaStreamSynchronize(s);
}
'''


def test_analysis_of_cuda_finds_nccl_calls_groups_streams_and_syncs(tmp_path):
    path = tmp_path / "host_gather.cu"
    path.write_text(CUDA_SOURCE)
    report = analyze_program(path)
    assert report.language == "cuda"
    assert [(c.name, c.line) for c in report.collectives] == [("ncclSend", 8), ("ncclRecv", 9), ("ncclAllGather", 11)]
    send, recv, gather = report.collectives
    assert send.buffers == ("send_buf",) and "peer=peer" in send.options and "stream=s" in send.options
    assert recv.buffers == ("recv_buf + offset(peer, count)",)
    assert any("ncclGroupStart at line 7" in o for o in recv.options)
    assert gather.buffers == ("a_shard", "a_full") and gather.options == ("stream=s",)  # spans two lines
    assert [(s.kind, s.line) for s in report.streams] == [("cudaStreamCreateWithFlags", 5)]
    assert [(s.kind, s.line) for s in report.sync_points] == [("ncclGroupStart", 7), ("ncclGroupEnd", 10),
                                                              ("cudaStreamSynchronize", 14)]
    assert [(s.kind, s.line) for s in report.device] == [("kernel launch", 13)]
    assert "(CUDA, host NCCL calls)" in report.render_prompt()


def test_analysis_errors_say_what_is_wrong(tmp_path):
    (tmp_path / "notes.txt").write_text("dist.all_reduce(x)")
    with pytest.raises(AnalysisError, match=r"neither a Python file .* nor a CUDA file"):
        analyze_program(tmp_path / "notes.txt")
    with pytest.raises(AnalysisError, match="no such file"):
        analyze_program(tmp_path / "missing.py")
    (tmp_path / "local.py").write_text("import torch\n\ndef run(ctx, state, inputs, out):\n    out.copy_(inputs['a'])\n")
    with pytest.raises(AnalysisError, match="issues no host collective .*torch.distributed.all_gather_into_tensor"):
        analyze_program(tmp_path / "local.py")
    (tmp_path / "kernel.cu").write_text("__global__ void k(float* x) { x[0] = 1; }\n")
    with pytest.raises(AnalysisError, match="no host collective .*ncclAllGather"):
        analyze_program(tmp_path / "kernel.cu")
    (tmp_path / "broken.py").write_text("def run(:\n")
    with pytest.raises(AnalysisError, match="syntax error at line 1"):
        analyze_program(tmp_path / "broken.py")


# -- the scripted GEMM conversion (its CPU-side checks) -------------------------------------------
def test_gemm_scripts_compile_and_replace_the_collective():
    """Stage A keeps the all-gather and adds the infrastructure; both stage B answers have no host
    collective, compile with nvcc against NCCL's headers, and differ only in the destination offset."""
    from cuda_host import toolchain_or_skip
    from commweave.runtime.compile import compile_cubin

    toolchain_or_skip()
    stage_a = analyze_source(extract_code(script("gemm", "stage_a")), "python", "stage A")
    assert [c.name for c in stage_a.collectives] == ["all_gather_into_tensor"]
    assert {s.kind for s in stage_a.device} == {"ctx.symmetric", "ctx.window", "ctx.dev_comm"}
    programs = [extract_code(script("gemm", name)) for name in ("stage_b_1", "stage_b_2")]
    for text in programs:
        assert analyze_source(text, "python", "stage B").collectives == []
        artifact = compile_cubin(parse_program(text).cuda_sources["CUDA_SRC"])
        assert "'fp_allgather_push'" in artifact.log and "0 bytes stack frame" in artifact.log
    changed = [line for line in programs[1].splitlines() if line not in programs[0].splitlines()]
    assert any("shard_offset = a_offset + (size_t)me * shard_bytes" in line for line in changed)
    assert len(changed) == 3  # the comment, the offset, its use


# -- the fast path through real HTTP servers ------------------------------------------------------
TOY_FLOW = [Reply(script("toy", "stage_a"), 2100, 400), Reply(script("toy", "stage_b_1"), 2600, 450),
            Reply(script("toy", "judge_1"), 1500, 180), Reply(script("toy", "stage_b_2"), 3900, 420)]


@pytest.mark.parametrize("server", [ScriptedOpenAIServer, ScriptedAnthropicServer], ids=["openai", "anthropic"])
def test_fast_path_needs_one_judge_round(toy_evaluator, server, tmp_path):
    with server(TOY_FLOW) as srv:
        agent, records = toy_agent(toy_evaluator, srv)
        result = agent.run(TOY_INPUT)
        prompts = [srv.prompt(i) for i in range(len(srv.requests))]
    assert result.ok, result.message
    assert [(a.stage, a.attempt, a.ok, a.failure) for a in result.attempts] == [
        ("input", 0, True, None), ("A", 1, True, None), ("B", 1, False, "wrong_result"), ("B", 2, True, None)]
    failed = result.attempts[2]
    assert "relative error" in failed.message and failed.diagnosis == script("toy", "judge_1").strip()
    assert [r.purpose for r in records] == ["fast_path", "fast_path", "judge", "fast_path"]
    assert all(r.outcome == "ok" for r in records)

    stage_a_prompt, stage_b_prompt, judge, retry = prompts
    assert "stage A of 2" in stage_a_prompt and "line 13, in run(): `all_gather`" in stage_a_prompt
    assert "ncclGetLsaPointer" in stage_a_prompt and "relative Frobenius error" in stage_a_prompt
    assert "stage B of 2" in stage_b_prompt and "placement: `deferred`" in stage_b_prompt
    assert "line 14, in run(): `all_gather_into_tensor`" in stage_b_prompt  # stage A's analysis, not the input's
    assert extract_code(script("toy", "stage_a")).strip() in stage_b_prompt
    assert JUDGE_SYSTEM in judge and "do not prescribe" in judge.lower() and "wrong_result" in judge
    assert "relative error" in judge and re.search(r"21\| +pending.append\(dist.irecv", judge)
    assert "attempt 1) failed: wrong_result" in retry and failed.diagnosis in retry
    assert "a_full[me * m:(me + 1) * m], frm" in retry  # the failed program itself

    assert directives_of(result.program) == conservative_directives(None, 2)
    assert program_body(result.program) == extract_code(script("toy", "stage_b_2"))
    tokens = [(2100, 400), (2600 + 1500, 450 + 180), (3900, 420)]
    assert [(a.input_tokens, a.output_tokens) for a in result.attempts[1:]] == tokens
    assert result.cost_usd == pytest.approx(sum(i * 3.0 + o * 15.0 for i, o in tokens) / 1e6)
    assert result.cost_usd == pytest.approx(sum(r.cost_usd for r in records))

    program_path, log_path = result.write(tmp_path / "fast.py")
    assert program_path.read_text() == result.program and log_path == attempt_log_path(tmp_path / "fast.py")
    log = json.loads(log_path.read_text())
    assert log["ok"] and [a["stage"] for a in log["attempts"]] == ["input", "A", "B", "B"]
    assert log["attempts"][2]["diagnosis"] == failed.diagnosis and log["attempts"][2]["failure"] == "wrong_result"
    assert log["cost_usd"] == pytest.approx(result.cost_usd) and log["directives"]["placement"] == "deferred"


def test_malformed_answer_is_a_failed_attempt_with_the_error_fed_back(toy_evaluator):
    no_fence = "Here is the program:\n\ndef setup(ctx, shape):\n    return {}\n"
    cut_off = "```python\ndef setup(ctx, shape):\n    return {}\n"
    flow = [no_fence, cut_off, TOY_FLOW[0], TOY_FLOW[3]]
    with ScriptedOpenAIServer(flow) as srv:
        agent, records = toy_agent(toy_evaluator, srv)
        result = agent.run(TOY_INPUT)
        prompts = [srv.prompt(i) for i in range(len(srv.requests))]
    assert result.ok, result.message
    assert [(a.stage, a.ok, a.failure) for a in result.attempts] == [
        ("input", True, None), ("A", False, "parse_error"), ("A", False, "parse_error"), ("A", True, None),
        ("B", True, None)]
    assert "no ```python fenced block" in result.attempts[1].message
    assert "never closed" in result.attempts[2].message
    assert "failed: parse_error" in prompts[1] and "no ```python fenced block" in prompts[1]
    assert "never closed" in prompts[2]
    assert "judge" not in [r.purpose for r in records]  # nothing ran, nothing to diagnose


def test_unreachable_model_is_a_failed_attempt_not_a_crash(toy_evaluator):
    """HTTP 500 on the first call and both retries: that attempt fails as llm_error, the next one
    gets the stage's prompt without feedback, and the run goes on."""
    with ScriptedOpenAIServer([Fail(500)] * 3 + [TOY_FLOW[0], TOY_FLOW[3]]) as srv:
        agent, records = toy_agent(toy_evaluator, srv)
        result = agent.run(TOY_INPUT)
        retry = srv.prompt(3)
    assert result.ok, result.message
    assert [(a.stage, a.failure) for a in result.attempts] == [("input", None), ("A", "llm_error"), ("A", None),
                                                               ("B", None)]
    assert "could not be reached" in result.attempts[1].message and "previous attempt" not in retry
    assert [r.outcome for r in records] == ["server_error"] * 3 + ["ok", "ok"]


def test_attempts_are_bounded_and_failure_is_a_result(toy_evaluator, tmp_path):
    wrong = TOY_FLOW[1]
    with ScriptedOpenAIServer([TOY_FLOW[0], wrong, TOY_FLOW[2], wrong]) as srv:
        agent, records = toy_agent(toy_evaluator, srv, attempts=2)
        result = agent.run(TOY_INPUT)
        assert srv.remaining == 0 and len(srv.requests) == 4  # no judge after the last attempt
    assert not result.ok and result.program is None and result.stage == "B"
    assert "stage B found no passing program in 2 attempts" in result.message
    assert [(a.stage, a.failure) for a in result.attempts][-2:] == [("B", "wrong_result"), ("B", "wrong_result")]
    program_path, log_path = result.write(tmp_path / "fast.py")
    assert program_path is None and not (tmp_path / "fast.py").exists()
    assert json.loads(log_path.read_text())["ok"] is False


def test_stage_b_must_leave_no_host_collective(toy_evaluator):
    """With require_device_initiated (the default), an answer still calling torch.distributed is
    refused before the cascade, and the next prompt says which calls remain."""
    host_b = TOY_FLOW[3]
    with ScriptedOpenAIServer([TOY_FLOW[0], host_b, host_b]) as srv:
        agent, records = toy_agent(toy_evaluator, srv, attempts=2, require_device_initiated=True)
        result = agent.run(TOY_INPUT)
        retry = srv.prompt(2)
    assert not result.ok and [(a.stage, a.failure) for a in result.attempts][-2:] == [
        ("B", "host_collectives"), ("B", "host_collectives")]
    assert "still has isend at line 20; irecv at line 21" in result.attempts[-1].message
    assert "failed: host_collectives" in retry and "isend at line 20" in retry
    assert [r.purpose for r in records] == ["fast_path"] * 3


def test_budget_stops_the_run_cleanly(toy_evaluator):
    """Each call's worst case is $0.0075 (500 tokens out at $15 per million, prompts free): the
    first fits a $0.012 budget and costs $0.006; the second's worst case no longer fits."""
    with ScriptedOpenAIServer(TOY_FLOW) as srv:
        agent, records = toy_agent(toy_evaluator, srv, budget=0.012, model=dict(input_usd_per_mtok=0.0, max_tokens=500))
        result = agent.run(TOY_INPUT)
        assert len(srv.requests) == 1
    assert not result.ok and "budget is spent" in result.message and result.stage == "B"
    assert [r.outcome for r in records] == ["ok", "budget"]
    assert [(a.stage, a.failure) for a in result.attempts][-1] == ("B", "budget")
    assert result.cost_usd == pytest.approx(0.006) and agent.client.ledger.spent_usd <= 0.012


TRUNCATED = b'{"id": "chatcmpl-1", "choices": [{"index": 0, "message": {"role": "assistant", "content": "```python'
FAST_PATH_REPLIES = {
    # case: (the reply, the outcome of its call, words of the attempt's message, model overrides)
    "truncated-json": (Raw(TRUNCATED), "bad_response", "truncated or malformed JSON", {}),
    "html": (Raw(b"<!DOCTYPE html><title>504 Gateway Timeout</title>", content_type="text/html"), "bad_response",
             "an HTML page", {}),
    "not-json": (Raw(b"Internal proxy error", content_type="text/plain"), "bad_response", "is not JSON", {}),
    "5mb-body": (Reply(script("toy", "stage_a") + "#" * 5_000_000, 2100, 400), "bad_response",
                 "over max_reply_bytes=2097152", {}),
    "negative-usage": (Reply(script("toy", "stage_a"), -2100, 400), "bad_response", "not a token count >= 0", {}),
    "trickle": (Trickle(script("toy", "stage_a"), interval_s=0.05), "timeout", "timeout_s=0.4 s",
                dict(timeout_s=0.4, max_retries=0)),
}


@pytest.mark.parametrize("case", list(FAST_PATH_REPLIES))
def test_an_unusable_reply_is_a_recorded_attempt_not_a_crash(toy_evaluator, tmp_path, case):
    """The attempt fails as llm_error naming the call's outcome and reason, its call (charged its
    worst case) is in the attempt log, and the run goes on or ends as a result."""
    reply, outcome, words, model = FAST_PATH_REPLIES[case]
    flow = [reply, TOY_FLOW[0], TOY_FLOW[3]] if case == "html" else [reply]
    with ScriptedOpenAIServer(flow) as srv:
        agent, records = toy_agent(toy_evaluator, srv, attempts=2 if case == "html" else 1, model=model)
        result = agent.run(TOY_INPUT)
    failed = result.attempts[1]
    assert (failed.stage, failed.failure) == ("A", "llm_error") and words in failed.message, failed.message
    assert f"({outcome})" in failed.message
    assert [c["outcome"] for c in failed.calls] == [outcome] and records[0].outcome == outcome
    assert failed.cost_usd == pytest.approx(records[0].cost_usd) and failed.cost_usd > 0
    assert result.ok == (case == "html") and result.cost_usd == pytest.approx(sum(r.cost_usd for r in records))
    _, log_path = result.write(tmp_path / "fast.py")
    logged = json.loads(log_path.read_text())["attempts"][1]
    assert logged["failure"] == "llm_error" and logged["calls"][0]["outcome"] == outcome
    assert words in logged["calls"][0]["message"]


def test_a_reply_without_usage_is_charged_its_worst_case(toy_evaluator):
    with ScriptedOpenAIServer([Reply(script("toy", "stage_a"), usage=False), TOY_FLOW[3]]) as srv:
        agent, records = toy_agent(toy_evaluator, srv, model=dict(input_usd_per_mtok=0.0, max_tokens=500))
        with pytest.warns(RuntimeWarning, match="no token usage"):
            result = agent.run(TOY_INPUT)
    assert result.ok, result.message
    assert [r.outcome for r in records] == ["ok", "ok"] and "no token usage" in result.attempts[1].calls[0]["message"]
    assert result.attempts[1].cost_usd == pytest.approx(500 * 15.0 / 1e6)  # max_tokens at the output price


def test_a_program_over_its_cap_is_a_failed_attempt(toy_evaluator):
    stage_a = script("toy", "stage_a")
    with ScriptedOpenAIServer([stage_a]) as srv:
        agent, records = toy_agent(toy_evaluator, srv, attempts=1, model=dict(max_program_bytes=100))
        result = agent.run(TOY_INPUT)
    failed = result.attempts[1]
    assert not result.ok and failed.failure == "parse_error"
    assert "over max_program_bytes=100 (the model's config)" in failed.message


def test_input_that_fails_the_cascade_stops_before_any_llm_call(toy_evaluator):
    with ScriptedOpenAIServer(TOY_FLOW) as srv:
        agent, _ = toy_agent(toy_evaluator, srv)
        result = agent.run(TESTS / "programs_cpu" / "wrong_values.py")
        assert srv.requests == []
    assert not result.ok and result.stage == "input" and "the input program fails the cascade" in result.message


def test_cuda_input_goes_to_stage_a_as_cuda(toy_evaluator, tmp_path):
    """A CUDA file cannot run in the harness: its analysis and text go to stage A, which ports it."""
    path = tmp_path / "host_gather.cu"
    path.write_text(CUDA_SOURCE)
    with ScriptedOpenAIServer([TOY_FLOW[0], TOY_FLOW[3]]) as srv:
        agent, _ = toy_agent(toy_evaluator, srv)
        result = agent.run(path)
        first = srv.prompt(0)
    assert result.ok and [a.stage for a in result.attempts] == ["A", "B"]
    assert "```cuda\n#include <nccl.h>" in first and "line 11: `ncclAllGather`" in first


# -- without an LLM -------------------------------------------------------------------------------
def test_without_llm_the_template_is_rendered_at_the_conservative_set(pool):
    """gemm-allgather's template renders the conservative set itself (deferred placement, one global
    barrier: CONFIG overlap=False, one chunk per shard); it compiles here, and the CPU workers
    report it needs GPUs."""
    wl = get_workload("gemm-allgather")
    template = wl.template()
    lines = []
    result = FastPath(wl, Evaluator(pool, wl), None, world_size=2, log=lines.append).run(EXAMPLE)
    ds, relaxed = renderable_conservative(template, 2)
    assert (ds.placement, ds.sync, ds.issuer, ds.backend) == ("deferred", "global", "cta", "lsa") and relaxed == ""
    (attempt,) = result.attempts
    assert attempt.stage == "template" and attempt.program == template.render(ds, template.default_shape(2), 2)
    assert "overlap=False" in attempt.program and "chunks=1" in attempt.program
    assert attempt.failure == "unavailable" and "needs CUDA GPUs" in attempt.message  # compiled, then refused
    assert not result.ok and result.model is None and result.cost_usd == 0
    assert "no LLM configured" in result.message and "nearest" not in result.message
    assert lines[0].startswith("no LLM configured")


def test_a_template_without_the_conservative_set_renders_the_nearest():
    """kv-transfer's template implements placement split with sync chunk only: the nearest set."""
    template = get_workload("kv-transfer").template()
    ds, relaxed = renderable_conservative(template, 2)
    assert (ds.placement, ds.sync) == ("split", "chunk")
    assert "implements placement split only" in relaxed and "placement split, sync chunk" in relaxed


def test_without_llm_or_template_is_a_clear_error(toy_evaluator):
    with pytest.raises(FastPathError, match="no LLM is configured and workload 'toy-gather-matmul' has no template"):
        FastPath(TOY, toy_evaluator, None, world_size=2).run(TOY_INPUT)


# -- the command ----------------------------------------------------------------------------------
def test_cli_fast_path_end_to_end_on_cpu(tmp_path):
    """`--device cpu` (a dry run: stage B may keep host calls) with the toy workload by class path;
    the result is benchmarked beside the toy's host baseline."""
    out = tmp_path / "toy_fast.py"
    with ScriptedOpenAIServer(TOY_FLOW) as srv:
        config = tmp_path / "llm.toml"
        config.write_text(f'[models.scripted]\nprovider = "openai"\nmodel = "m"\nbase_url = "{srv.base_url}"\n'
                          'input_usd_per_mtok = 3.0\noutput_usd_per_mtok = 15.0\ntimeout_s = 10\n')
        result = runner.invoke(app, ["agent", "fast-path", str(TOY_INPUT), "--workload", "toy_workload:ToyGatherMatmul",
                                     "--device", "cpu", "--gpus", "2", "--shape", "16x8x12", "--llm", "scripted",
                                     "--llm-config", str(config), "--out", str(out)])
    text = said(result)
    assert result.exit_code == 0, text
    assert directives_of(out.read_text()) is not None and attempt_log_path(out).exists()
    for words in ("stage A attempt 1: passed", "stage B attempt 1: wrong_result", "stage B attempt 2: passed",
                  "x over host at 16x8x12", "dry run"):
        assert words in text, words
    log = json.loads(attempt_log_path(out).read_text())
    assert log["evaluation"]["verdict"]["ok"] and log["evaluation"]["baseline"] == "host"


def test_cli_fast_path_errors_are_one_line(tmp_path):
    help_text = said(runner.invoke(app, ["agent", "fast-path", "--help"]))
    for option in ("--workload", "--gpus", "--shape", "--llm", "--llm-config", "--attempts", "--out"):
        assert option in help_text
    missing = runner.invoke(app, ["agent", "fast-path", str(tmp_path / "nope.py"), "--workload", "gemm-allgather"])
    assert missing.exit_code != 0 and "no such file" in said(missing)
    unknown = runner.invoke(app, ["agent", "fast-path", str(EXAMPLE), "--workload", "gemm"])
    assert unknown.exit_code != 0 and "unknown workload 'gemm'" in said(unknown)
    bad_llm = runner.invoke(app, ["agent", "fast-path", str(EXAMPLE), "--workload", "gemm-allgather", "--llm", "nobody"])
    assert bad_llm.exit_code != 0 and "unknown LLM 'nobody'" in said(bad_llm)
    gpus = runner.invoke(app, ["agent", "fast-path", str(EXAMPLE), "--workload", "gemm-allgather", "--gpus", "2"])
    assert gpus.exit_code != 0 and "needs 2 CUDA GPUs; this machine has 0" in said(gpus)


# -- GPUs -----------------------------------------------------------------------------------------
GPU_WORLD = min(torch.cuda.device_count(), 4)
GEMM_FLOW = ["stage_a", "stage_b_1", "judge_1", "stage_b_2"]


@pytest.mark.gpu
@pytest.mark.skipif(GPU_WORLD < 2, reason="needs at least 2 CUDA GPUs")
def test_fast_path_converts_the_host_gemm_allgather_on_gpus(tmp_path):
    """examples/host_gemm_allgather.py -> stage A (symmetric a_full, window, device comm; NCCL
    all-gather kept) -> stage B attempt 1 (destination offset from the receiver's rank: wrong
    result) -> the judge's diagnosis -> attempt 2 (LSA push kernel between two LSA barriers, then
    cuBLAS), which passes the cascade and is timed beside the baselines."""
    pytest.importorskip("openai", reason="the openai SDK (pip install 'commweave[llm]') is not installed here")
    wl = get_workload("gemm-allgather")
    shape = wl.parse_shape("4096x4096x4096", GPU_WORLD)
    lines = []
    with WorkerPool(GPU_WORLD, device="cuda", job_timeout_s=300) as pool, \
            ScriptedOpenAIServer([script("gemm", name) for name in GEMM_FLOW]) as srv:
        evaluator = Evaluator(pool, wl, job_timeout_s=120)
        client = client_for(srv.model(timeout_s=10, **PRICES), Ledger())
        result = FastPath(wl, evaluator, client, world_size=GPU_WORLD, log=lines.append).run(EXAMPLE, bench_shape=shape)
        result.write(tmp_path / "gemm_fast.py")
    print("\n".join(lines))
    assert [(a.stage, a.attempt, a.failure) for a in result.attempts] == [
        ("input", 0, None), ("A", 1, None), ("B", 1, "wrong_result"), ("B", 2, None)], "\n".join(lines)
    assert result.ok, result.message
    assert result.evaluation["verdict"]["ok"] and result.evaluation["median_us"] > 0
    assert "fp_allgather_push" in result.program and "torch.distributed" not in result.program


@pytest.mark.gpu
@pytest.mark.skipif(GPU_WORLD < 2, reason="needs at least 2 CUDA GPUs")
def test_fast_path_without_llm_passes_on_gpus():
    wl = get_workload("gemm-allgather")
    with WorkerPool(GPU_WORLD, device="cuda", job_timeout_s=300) as pool:
        result = FastPath(wl, Evaluator(pool, wl, job_timeout_s=120), None, world_size=GPU_WORLD).run(EXAMPLE)
    assert result.ok, result.message
