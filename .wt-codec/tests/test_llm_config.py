"""Model configuration (TOML file, environment, ad-hoc specs) and the model pool's bandit."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from commweave.llm import LLMClient, ModelConfig, ModelPool, load_models, resolve_model

CONFIG = """
[models.gpt]
provider = "openai"
model = "gpt-4.1"
input_usd_per_mtok = 2
output_usd_per_mtok = 8.0

[models.claude]
provider = "anthropic"
model = "claude-sonnet-4-5"
api_key_env = "WORK_ANTHROPIC_KEY"
max_retries = 6

[models.local-qwen]
provider = "openai"
model = "Qwen/Qwen2.5-Coder-32B-Instruct"
base_url = "http://localhost:8000/v1"
timeout_s = 600
"""


def _write(tmp_path: Path, text: str, name: str = "models.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_config_file(tmp_path):
    models = load_models(_write(tmp_path, CONFIG), env={})
    assert sorted(models) == ["claude", "gpt", "local-qwen"]
    assert models["gpt"] == ModelConfig(name="gpt", provider="openai", model="gpt-4.1", input_usd_per_mtok=2.0,
                                        output_usd_per_mtok=8.0)
    assert models["gpt"].cost_usd(1_000_000, 500_000) == pytest.approx(6.0)
    assert models["claude"].api_key_env == "WORK_ANTHROPIC_KEY" and models["claude"].max_retries == 6
    assert models["local-qwen"].base_url == "http://localhost:8000/v1" and models["local-qwen"].timeout_s == 600


def test_config_file_lookup(tmp_path, monkeypatch):
    named = _write(tmp_path, CONFIG)
    monkeypatch.chdir(tmp_path)
    assert load_models(env={}) == {}  # no file anywhere: no models
    assert sorted(load_models(env={"COMMWEAVE_LLM_CONFIG": str(named)})) == ["claude", "gpt", "local-qwen"]
    _write(tmp_path, '[models.here]\nprovider = "openai"\nmodel = "m"\n', "commweave-llm.toml")
    assert list(load_models(env={})) == ["here"]
    assert list(load_models(named, env={"COMMWEAVE_LLM_CONFIG": "elsewhere.toml"})) == ["gpt", "claude", "local-qwen"]
    with pytest.raises(FileNotFoundError, match="COMMWEAVE_LLM_CONFIG"):
        load_models(env={"COMMWEAVE_LLM_CONFIG": str(tmp_path / "missing.toml")})
    with pytest.raises(FileNotFoundError, match="missing.toml"):
        load_models(tmp_path / "missing.toml", env={})


@pytest.mark.parametrize("table, error", [
    ('provider = "gemini"\nmodel = "m"', "unknown provider 'gemini'"),
    ('provider = "openai"\nmodel = "m"\ninput_usd_per_mtok = -1', "input_usd_per_mtok must be >= 0"),
    ('provider = "openai"\nmodel = "m"\ntemprature = 0.5', r"\[models.bad\]: unknown key\(s\) temprature"),
    ('provider = "openai"', "missing 'model'"),
    ('provider = "openai"\nmodel = "m"\nmax_retries = "3"', "max_retries must be int"),
    ('provider = "openai"\nmodel = "m"\ntimeout_s = true', "timeout_s must be int or float"),
    ('provider = "openai"\nmodel = "m"\ntimeout_s = 0', "timeout_s must be > 0"),
    ('provider = "openai"\nmodel = "m"\nbase_url = "localhost:8000"', "must start with http"),
])
def test_config_errors_name_the_problem(tmp_path, table, error):
    path = _write(tmp_path, f"[models.bad]\n{table}\n")
    with pytest.raises(ValueError, match=error) as err:
        load_models(path, env={})
    assert str(path) in str(err.value)


def test_config_file_structure_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown top-level key"):
        load_models(_write(tmp_path, '[model.gpt]\nprovider = "openai"\nmodel = "m"\n'), env={})
    with pytest.raises(ValueError, match="not valid TOML"):
        load_models(_write(tmp_path, "[models.gpt\n"), env={})


def test_resolve_model_forms(tmp_path):
    models = load_models(_write(tmp_path, CONFIG), env={})
    assert resolve_model("claude", models) is models["claude"]
    adhoc = resolve_model("openai:gpt-4o-mini", models)
    assert (adhoc.name, adhoc.provider, adhoc.model, adhoc.base_url) == ("openai:gpt-4o-mini", "openai", "gpt-4o-mini",
                                                                         None)
    local = resolve_model("openai:Qwen/Qwen3-8B@http://127.0.0.1:8000/v1", models)
    assert (local.model, local.base_url) == ("Qwen/Qwen3-8B", "http://127.0.0.1:8000/v1")
    vertex = resolve_model("anthropic:claude-opus-4@20250514@https://proxy.example/anthropic", models)
    assert (vertex.provider, vertex.model, vertex.base_url) == ("anthropic", "claude-opus-4@20250514",
                                                                "https://proxy.example/anthropic")
    for spec in ("gpt5", "gemini:pro", "openai:"):
        with pytest.raises(ValueError, match=r"configured models are claude, gpt, local-qwen.*'openai:<model>"):
            resolve_model(spec, models)
    with pytest.raises(ValueError, match="configured models are none"):
        resolve_model("gpt", {})


class _Named(LLMClient):
    """A pool member that is never called: the bandit only needs names."""

    def __init__(self, name: str):
        super().__init__(ModelConfig(name=name, provider="openai", model=name, base_url="http://127.0.0.1:1/v1"))

    def _send(self, messages, system, temperature, max_tokens):
        raise AssertionError("the pool never sends")


def test_pool_tries_every_model_then_prefers_gain_per_dollar():
    pool = ModelPool([_Named("cheap"), _Named("dear"), _Named("useless")], seed=3)
    first = [pool.choose().name for _ in range(3)]
    assert first == ["cheap", "dear", "useless"]  # unseen models first, in order
    outcome = {"cheap": (0.05, 0.01), "dear": (0.05, 0.20), "useless": (0.0, 0.01)}  # (gain, $) per proposal
    for name in first:
        pool.reward(name, *outcome[name])
    picks = []
    for _ in range(60):
        name = pool.choose().name
        picks.append(name)
        pool.reward(name, *outcome[name])
    assert picks.count("cheap") > 40 and picks.count("dear") >= 1 and picks.count("useless") >= 1
    stats = pool.stats()
    assert stats["cheap"]["mean_reward"] == pytest.approx(5.0)  # 0.05 gain / $0.01
    assert stats["dear"]["mean_reward"] == pytest.approx(0.25)
    assert sum(s["pulls"] for s in stats.values()) == 63
    assert stats["useless"]["spent_usd"] == pytest.approx(0.01 * stats["useless"]["pulls"])


def test_pool_is_deterministic_and_checks_names():
    def run(seed):
        pool = ModelPool([_Named("a"), _Named("b")], seed=seed)
        out = []
        for _ in range(20):
            name = pool.choose().name
            out.append(name)
            pool.reward(name, 0.0, 0.0)  # all equal: only the seeded tie-break decides
        return out

    assert run(7) == run(7)
    assert run(7) != run(8) or run(7) != run(9)
    with pytest.raises(ValueError, match="not in the pool"):
        ModelPool([_Named("a")]).reward("b", 1.0, 1.0)
    with pytest.raises(ValueError, match="distinct"):
        ModelPool([_Named("a"), _Named("a")])
