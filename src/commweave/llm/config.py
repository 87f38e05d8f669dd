"""Which models a run may call: a TOML file of named models, or an ad-hoc `provider:model` spec.

```toml
[models.gpt]                       # the handle used on the command line: --llm gpt
provider = "openai"                # any OpenAI-compatible chat-completions server
model = "gpt-4.1"
input_usd_per_mtok = 2.0           # dollars per million tokens, for cost accounting and the budget
output_usd_per_mtok = 8.0

[models.local-qwen]
provider = "openai"
model = "Qwen/Qwen2.5-Coder-32B-Instruct"
base_url = "http://localhost:8000/v1"   # vLLM / SGLang / llama.cpp / Ollama: no key needed
```

The file is `path`, else $COMMWEAVE_LLM_CONFIG, else ./commweave-llm.toml. Keys come from the
environment (OPENAI_API_KEY / ANTHROPIC_API_KEY, or the variable a model's `api_key_env` names),
never from the file; OPENAI_BASE_URL / ANTHROPIC_BASE_URL apply to models without a base_url.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

PROVIDERS = ("openai", "anthropic")
#: where a provider's key and base URL come from when the model's table does not say
DEFAULT_KEY_ENV = {"openai": "OPENAI_API_KEY", "anthropic": "ANTHROPIC_API_KEY"}
DEFAULT_BASE_URL_ENV = {"openai": "OPENAI_BASE_URL", "anthropic": "ANTHROPIC_BASE_URL"}
CONFIG_ENV = "COMMWEAVE_LLM_CONFIG"
DEFAULT_CONFIG_FILE = "commweave-llm.toml"
SPEC_FORMS = "'openai:<model>[@<base_url>]' or 'anthropic:<model>[@<base_url>]'"


@dataclass(frozen=True)
class ModelConfig:
    name: str  # the user's handle, e.g. "gpt", "claude", "local-qwen"
    provider: str  # "openai" (any OpenAI-compatible chat-completions server) | "anthropic"
    model: str  # the provider's model id
    base_url: str | None = None
    api_key_env: str | None = None  # env var holding the key; default OPENAI_API_KEY / ANTHROPIC_API_KEY
    input_usd_per_mtok: float = 0.0  # prices per million tokens (0 for a local server)
    output_usd_per_mtok: float = 0.0
    timeout_s: float = 120.0  # one attempt's whole life: connect, send, every read of the reply
    max_retries: int = 4  # retries after 429 / 5xx / timeout, exponential backoff with jitter
    backoff_s: float = 1.0  # first backoff; tests set it tiny
    max_tokens: int = 8192
    temperature: float | None = None  # replaces the caller's (OpenAI-compatible; reasoning models accept only 1.0)
    max_reply_bytes: int = 2 * 2**20  # a reply's body; a larger one is a bad_response, not read further
    max_program_bytes: int = 256 * 2**10  # a program taken from a reply; a larger one is refused
    max_prompt_bytes: int = 2**20  # system prompt + conversation, UTF-8; a larger one is not sent

    def __post_init__(self) -> None:
        where = f"model {self.name!r}"
        if not self.name:
            raise ValueError("a model needs a non-empty name")
        if self.provider not in PROVIDERS:
            raise ValueError(f"{where}: unknown provider {self.provider!r}; use one of {', '.join(PROVIDERS)} "
                             "('openai' covers every OpenAI-compatible server: vLLM, SGLang, llama.cpp, Ollama)")
        if not self.model:
            raise ValueError(f"{where}: 'model' (the provider's model id) is empty")
        if self.base_url is not None and not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"{where}: base_url {self.base_url!r} must start with http:// or https://")
        for key in ("input_usd_per_mtok", "output_usd_per_mtok", "backoff_s"):
            if getattr(self, key) < 0:
                raise ValueError(f"{where}: {key} must be >= 0, got {getattr(self, key)}")
        if self.timeout_s <= 0:
            raise ValueError(f"{where}: timeout_s must be > 0, got {self.timeout_s}")
        if self.max_retries < 0:
            raise ValueError(f"{where}: max_retries must be >= 0, got {self.max_retries}")
        for key in ("max_tokens", "max_reply_bytes", "max_program_bytes", "max_prompt_bytes"):
            if getattr(self, key) <= 0:
                raise ValueError(f"{where}: {key} must be > 0, got {getattr(self, key)}")
        if self.temperature is not None and self.temperature < 0:
            raise ValueError(f"{where}: temperature must be >= 0, got {self.temperature}")

    def cost_usd(self, input_tokens: int, output_tokens: int) -> float:
        return (input_tokens * self.input_usd_per_mtok + output_tokens * self.output_usd_per_mtok) / 1e6

    def worst_case_usd(self, prompt_bytes: int, messages: int, max_tokens: int) -> float:
        """The most one attempt can cost: `max_tokens` out, and in the prompt's tokens bounded from
        above (a token covers at least one byte of UTF-8 in byte-level tokenizers, plus each
        message's chat-template tokens)."""
        return self.cost_usd(prompt_tokens_bound(prompt_bytes, messages), max_tokens)


#: chat-template tokens counted per message (role markers, separators) and per prompt
TEMPLATE_TOKENS_PER_MESSAGE = 16
TEMPLATE_TOKENS_PER_PROMPT = 64


def prompt_tokens_bound(prompt_bytes: int, messages: int) -> int:
    """An upper bound on a prompt's input tokens, from its UTF-8 size and number of messages."""
    return prompt_bytes + TEMPLATE_TOKENS_PER_MESSAGE * messages + TEMPLATE_TOKENS_PER_PROMPT


#: the TOML type each ModelConfig field accepts (ints are fine where floats are expected)
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "provider": (str,), "model": (str,), "base_url": (str,), "api_key_env": (str,),
    "input_usd_per_mtok": (int, float), "output_usd_per_mtok": (int, float), "timeout_s": (int, float),
    "max_retries": (int,), "backoff_s": (int, float), "max_tokens": (int,), "temperature": (int, float),
    "max_reply_bytes": (int,), "max_program_bytes": (int,), "max_prompt_bytes": (int,),
}
assert set(_FIELD_TYPES) == {f.name for f in dataclasses.fields(ModelConfig)} - {"name"}


def _model_from_table(name: str, table: Any, source: str) -> ModelConfig:
    where = f"{source}: [models.{name}]"
    if not isinstance(table, dict):
        raise ValueError(f"{where} must be a table of settings, got {type(table).__name__}")
    unknown = sorted(set(table) - set(_FIELD_TYPES))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(_FIELD_TYPES)}")
    for key in ("provider", "model"):
        if key not in table:
            raise ValueError(f"{where}: missing {key!r}")
    for key, value in table.items():
        types = _FIELD_TYPES[key]
        if isinstance(value, bool) or not isinstance(value, types):
            wanted = " or ".join(t.__name__ for t in types)
            raise ValueError(f"{where}: {key} must be {wanted}, got {value!r}")
    try:
        return ModelConfig(name=name, **table)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            raise ImportError("reading the LLM config on Python 3.10 needs tomli: "
                              "pip install 'commweave[llm]'") from None
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: not valid TOML: {e}") from None


def load_models(path: Path | None = None, env: Mapping[str, str] = os.environ) -> dict[str, ModelConfig]:
    """The models of `path`, else of $COMMWEAVE_LLM_CONFIG, else of ./commweave-llm.toml, else none.
    A file named explicitly (argument or variable) must exist."""
    if path is None and env.get(CONFIG_ENV):
        path = Path(env[CONFIG_ENV])
        if not path.is_file():
            raise FileNotFoundError(f"${CONFIG_ENV} names {path}, which is not a file")
    elif path is None:
        path = Path(DEFAULT_CONFIG_FILE)
        if not path.is_file():
            return {}
    elif not Path(path).is_file():
        raise FileNotFoundError(f"LLM config {path} is not a file")
    data = _read_toml(Path(path))
    unknown = sorted(set(data) - {"models"})
    if unknown:
        raise ValueError(f"{path}: unknown top-level key(s) {', '.join(unknown)}; models go in [models.<name>] tables")
    models = data.get("models", {})
    if not isinstance(models, dict):
        raise ValueError(f"{path}: 'models' must be tables [models.<name>]")
    return {name: _model_from_table(name, table, str(path)) for name, table in models.items()}


def resolve_model(spec: str, models: dict[str, ModelConfig] | None = None) -> ModelConfig:
    """A configured model's name, or an ad-hoc 'openai:<model>[@<base_url>]' /
    'anthropic:<model>[@<base_url>]' (no prices: costs count as $0). `models=None` loads the config."""
    if models is None:
        models = load_models()
    if spec in models:
        return models[spec]
    provider, sep, rest = spec.partition(":")
    if sep and provider in PROVIDERS and rest:
        # the base URL follows the last '@' that starts a URL (model ids may contain '@' themselves)
        at = max(rest.rfind("@http://"), rest.rfind("@https://"))
        model, base_url = (rest[:at], rest[at + 1:]) if at >= 0 else (rest, None)
        return ModelConfig(name=spec, provider=provider, model=model, base_url=base_url)
    names = ", ".join(sorted(models)) or "none"
    raise ValueError(f"unknown LLM {spec!r}: configured models are {names} "
                     f"(from ${CONFIG_ENV} or ./{DEFAULT_CONFIG_FILE}); or write {SPEC_FORMS}")
