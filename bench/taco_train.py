"""Figure: TACO's training check (docs/results.md; taco-train-*.json and its loss-curve plot).

A GPT-style decoder trained tensor parallel + sequence parallel
over the world, once with plain collectives and once with TACO compression (QuantConfig defaults,
forward and gradient), same seed, same data order; loss curves, step times, final-loss difference.

    python bench/taco_train.py --gpus 4 --backend device          # 4 GPUs (defaults: 6x1024, 300 steps)
    python bench/taco_train.py --cpu-ranks 2 --tiny               # CPU, gloo, a few seconds
    python bench/taco_train.py --gpus 4 --backend device --graph  # each step one CUDA graph replay

Data: byte-level tokens (vocabulary 256) of the Python standard library's own .py files (the
directory of `os.__file__`, site-packages excluded), in sorted path order; every 20th file is
validation, so the split is by file and disjoint. The stdlib differs between Python versions, so
the results record a fingerprint of the file list.

Layout (Megatron sequence parallelism, [seq, batch, hidden]): every rank holds seq/W tokens of the
residual stream; attention QKV and MLP-up are ColumnParallelLinear (all-gather of the sequence in,
heads / ffn columns sharded), attention-out and MLP-down are RowParallelLinear (reduce-scatter back
to the sequence shard). Embeddings, LayerNorms and the (byte-vocabulary, small) LM head are
replicated and see only the local tokens, so their gradients are summed over the ranks
(`sequence_parallel` params, `tp.allreduce_sequence_parallel_grads`). Weights are initialised once
from the seed as a full single-process model and sharded with `load_full_weight`, so both runs (and
any world size) start from the same parameters.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

VOCAB = 256
SEPARATOR = 0  # byte between files (source files contain no NUL)
VAL_EVERY_NTH_FILE = 20
GRAPH_WARMUP = 3  # --graph: eager steps before the step is captured (buffers and launch records made)


# -- data --------------------------------------------------------------------------------------

def stdlib_files(root: str | None = None) -> list[Path]:
    """The stdlib's .py files in a deterministic (sorted relative path) order; site-packages is
    excluded because it depends on what is installed, not on the Python version."""
    base = Path(root or os.path.dirname(os.__file__))
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__")]
        found.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return sorted(found, key=lambda p: p.relative_to(base).as_posix())


@dataclass(frozen=True)
class Corpus:
    train: torch.Tensor  # uint8 token stream
    val: torch.Tensor
    train_files: tuple[str, ...]
    val_files: tuple[str, ...]
    fingerprint: str  # sha256 of the relative paths and sizes

    def info(self) -> dict[str, Any]:
        return {"train_files": len(self.train_files), "val_files": len(self.val_files),
                "train_bytes": int(self.train.numel()), "val_bytes": int(self.val.numel()),
                "fingerprint": self.fingerprint, "root": os.path.dirname(os.__file__),
                "python": sys.version.split()[0]}


@lru_cache(maxsize=4)
def load_corpus(max_bytes: int | None = None, root: str | None = None) -> Corpus:
    """Train/val byte streams: file i goes to val when i % 20 == 19 (split by file, disjoint).
    `max_bytes` stops after that many bytes of files (small runs need not read 30 MB)."""
    base = Path(root or os.path.dirname(os.__file__))
    parts: dict[str, list[bytes]] = {"train": [], "val": []}
    names: dict[str, list[str]] = {"train": [], "val": []}
    digest = hashlib.sha256()
    total = 0
    for i, path in enumerate(stdlib_files(str(base))):
        data = path.read_bytes().replace(b"\x00", b"")
        rel = path.relative_to(base).as_posix()
        split = "val" if i % VAL_EVERY_NTH_FILE == VAL_EVERY_NTH_FILE - 1 else "train"
        parts[split].append(data + bytes([SEPARATOR]))
        names[split].append(rel)
        digest.update(f"{rel}:{len(data)}\n".encode())
        total += len(data)
        if max_bytes is not None and total >= max_bytes and names["val"]:
            break
    streams = {k: torch.frombuffer(bytearray(b"".join(v)), dtype=torch.uint8) for k, v in parts.items()}
    return Corpus(streams["train"], streams["val"], tuple(names["train"]), tuple(names["val"]), digest.hexdigest())


def train_batch(corpus: Corpus, step: int, batch: int, seq: int, seed: int) -> torch.Tensor:
    """[seq + 1, batch] int64 tokens at offsets drawn from (seed, step): the same on every rank, in
    both modes, independent of what ran before."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, corpus.train.numel() - seq - 1, (batch,), generator=gen)
    return torch.stack([corpus.train[s:s + seq + 1] for s in starts.tolist()], dim=1).long()


def val_batches(corpus: Corpus, count: int, batch: int, seq: int) -> list[torch.Tensor]:
    """Fixed validation windows, evenly spaced over the validation stream."""
    span = corpus.val.numel() - seq - 1
    n = count * batch
    starts = [(i * span) // max(n - 1, 1) for i in range(n)]
    windows = [corpus.val[s:s + seq + 1] for s in starts]
    return [torch.stack(windows[i * batch:(i + 1) * batch], dim=1).long() for i in range(count)]


# -- model -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelConfig:
    layers: int = 6
    hidden: int = 1024
    heads: int = 16
    seq: int = 1024
    ffn_mult: int = 4
    tied: bool = True


def _linear(kind: str, tp: bool, din: int, dout: int, cfg: Any, backend: str) -> nn.Module:
    """nn.Linear in the reference model; the taco.tp layer of that kind in the TP model."""
    if not tp:
        return nn.Linear(din, dout)
    from commweave.taco.tp import ColumnParallelLinear, RowParallelLinear

    cls = ColumnParallelLinear if kind == "column" else RowParallelLinear
    return cls(din, dout, bias=True, compression=cfg, grad_compression=cfg, backend=backend)


class Block(nn.Module):
    """Pre-LN attention + MLP. QKV rows are ordered [head, (q, k, v), head_dim], so a column shard
    holds whole heads with their q, k and v (Megatron's layout)."""

    def __init__(self, mc: ModelConfig, tp: bool, compression: Any, backend: str, compute_dtype: torch.dtype):
        super().__init__()
        h = mc.hidden
        self.head_dim = h // mc.heads
        self.compute_dtype = compute_dtype
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv = _linear("column", tp, h, 3 * h, compression, backend)
        self.proj = _linear("row", tp, h, h, compression, backend)
        self.up = _linear("column", tp, h, mc.ffn_mult * h, compression, backend)
        self.down = _linear("row", tp, mc.ffn_mult * h, h, compression, backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [s_local, b, h]; the column layers' all-gather runs in the compute dtype (BF16 on GPUs)
        qkv = self.qkv(self.ln1(x).to(self.compute_dtype))  # [s, b, 3 * h_local]
        s, b, width = qkv.shape
        heads = width // (3 * self.head_dim)
        q, k, v = qkv.view(s, b, heads, 3, self.head_dim).permute(3, 1, 2, 0, 4).unbind(0)  # [b, heads, s, d]
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.permute(2, 0, 1, 3).reshape(s, b, heads * self.head_dim))
        up = nn.functional.gelu(self.up(self.ln2(x).to(self.compute_dtype)))
        return x + self.down(up)


class GPT(nn.Module):
    """Byte-level decoder. `tp=False`: the single-process reference on the full sequence;
    `tp=True`: TP/SP over the default group, fed this rank's sequence shard."""

    def __init__(self, mc: ModelConfig, tp: bool = False, compression: Any = None, backend: str = "reference",
                 compute_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.mc, self.tp = mc, tp
        self.wte = nn.Embedding(VOCAB, mc.hidden)
        self.wpe = nn.Embedding(mc.seq, mc.hidden)
        self.blocks = nn.ModuleList(Block(mc, tp, compression, backend, compute_dtype) for _ in range(mc.layers))
        self.ln_f = nn.LayerNorm(mc.hidden)
        self.head = None if mc.tied else nn.Linear(mc.hidden, VOCAB, bias=False)
        if tp:  # replicated params see only this rank's tokens: their grads are summed over ranks
            for name, p in self.named_parameters():
                if "blocks." not in name or ".ln" in name:
                    p.sequence_parallel = True

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """GPT-2 init from a CPU generator: N(0, 0.02), residual projections / sqrt(2 layers)."""
        gen = torch.Generator().manual_seed(seed)
        for name, p in sorted(self.named_parameters()):
            if p.dim() == 1:
                p.copy_(torch.ones_like(p) if name.endswith("ln1.weight") or name.endswith("ln2.weight")
                        or name.endswith("ln_f.weight") else torch.zeros_like(p))
                continue
            std = 0.02 / math.sqrt(2 * self.mc.layers) if name.endswith(("proj.weight", "down.weight")) else 0.02
            p.copy_(torch.randn(p.shape, generator=gen) * std)

    @torch.no_grad()
    def load_from_reference(self, ref: GPT) -> None:
        """This rank's shards of a reference model's weights (the TP layers via load_full_weight)."""
        from commweave.taco.tp import ColumnParallelLinear, RowParallelLinear

        mine = dict(self.named_modules())
        for name, module in ref.named_modules():
            target = mine[name]
            if isinstance(target, (ColumnParallelLinear, RowParallelLinear)):
                target.load_full_weight(module.weight, module.bias)
            elif isinstance(target, (nn.Embedding, nn.LayerNorm)) or (name == "head" and target is not None):
                for pname, p in module.named_parameters(recurse=False):
                    getattr(target, pname).copy_(p)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor, position0: int = 0) -> torch.Tensor:
        """Sum of cross-entropy over these [s_local, b] tokens (the caller divides by the global
        token count, so per-rank losses add up to the mean)."""
        s = tokens.shape[0]
        pos = torch.arange(position0, position0 + s, device=tokens.device)
        x = self.wte(tokens) + self.wpe(pos)[:, None, :]
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        logits = x @ self.wte.weight.T if self.head is None else self.head(x)
        return nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1), reduction="sum")


def global_grad_norm(model: GPT) -> torch.Tensor:
    """L2 norm of the whole (unsharded) gradient: sharded params' squares summed over ranks,
    replicated ones (identical after their all-reduce) counted once."""
    sharded = torch.zeros((), dtype=torch.float32, device=next(model.parameters()).device)
    replicated = torch.zeros_like(sharded)
    for p in model.parameters():
        if p.grad is None:
            continue
        sq = p.grad.float().pow(2).sum()
        if model.tp and not getattr(p, "sequence_parallel", False):
            sharded += sq
        else:
            replicated += sq
    if model.tp:
        dist.all_reduce(sharded)
    return (sharded + replicated).sqrt()


# -- training job (runs in every worker) ---------------------------------------------------------

@dataclass(frozen=True)
class TrainConfig:
    steps: int = 300
    batch: int = 8
    lr: float = 6e-4
    warmup: int = 30
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    clip: float = 1.0
    seed: int = 1234
    eval_points: int = 4  # validation at this many evenly spaced steps (and the last)
    val_batches: int = 4
    max_bytes: int | None = None  # read only this much of the stdlib (small runs)


def lr_at(step: int, tc: TrainConfig) -> float:
    """Linear warmup, cosine decay to min_lr_ratio * lr."""
    if step < tc.warmup:
        return tc.lr * (step + 1) / tc.warmup
    t = (step - tc.warmup) / max(tc.steps - tc.warmup, 1)
    return tc.lr * (tc.min_lr_ratio + (1 - tc.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def eval_steps(tc: TrainConfig) -> list[int]:
    """Steps after which validation runs: evenly spaced, always the last."""
    pts = {round(tc.steps * (i + 1) / tc.eval_points) - 1 for i in range(tc.eval_points)}
    return sorted(p for p in pts | {tc.steps - 1} if p >= 0)


def _shard(window: torch.Tensor, rank: int, world: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Inputs and targets of this rank's sequence shard, and its first position."""
    seq = window.shape[0] - 1
    s = seq // world
    lo = rank * s
    return window[lo:lo + s].to(device), window[lo + 1:lo + s + 1].to(device), lo


def train_job(ctx: Any, model: dict, train: dict, compress: bool, backend: str = "reference",
              dtype: str = "float32", reference_steps: int = 0, graph: bool = False) -> dict:
    """Train the TP/SP model for train['steps'] steps (compression on or off) and return the loss
    history, validation losses and step times. With reference_steps > 0, also train the
    single-process reference model (full sequence, same weights, same batches) for that many
    steps and return its losses, to check the TP model against it. graph (CUDA): after GRAPH_WARMUP eager steps, each step
    (forward, backward, gradient sums, clipping, optimizer) is one CUDA graph replay, so a step
    costs its GPU time, not the host's launches (the optimizer is then AdamW's capturable form,
    whose learning rate is a tensor)."""
    from commweave.taco import collectives as cc
    from commweave.taco.quant import QuantConfig
    from commweave.taco.tp import allreduce_sequence_parallel_grads

    mc, tc = ModelConfig(**model), TrainConfig(**train)
    world, rank, device = ctx.world_size, ctx.rank, ctx.device
    if mc.seq % world or mc.heads % world or mc.hidden % mc.heads:
        raise ValueError(f"seq {mc.seq} and heads {mc.heads} must divide by the world {world}, hidden by heads")
    compute_dtype = getattr(torch, dtype)
    if backend == "device":
        # bind the device backend to the pool's context instead of making a second one
        from commweave.taco.device import DeviceBackend

        cc.register_backend("device", DeviceBackend(ctx=ctx))
    cfg = QuantConfig() if compress else None
    corpus = load_corpus(tc.max_bytes)

    ref = GPT(mc)
    ref.init_weights(tc.seed)
    net = GPT(mc, tp=True, compression=cfg, backend=backend, compute_dtype=compute_dtype).to(device)
    net.load_from_reference(ref)
    ref_state = {k: v.clone() for k, v in ref.state_dict().items()} if reference_steps else None
    del ref

    if graph and device.type != "cuda":
        raise ValueError("graph=True captures CUDA graphs: it needs GPU ranks")
    opt = _optimizer(net, tc, capturable=graph)
    # autocast's cast cache would hand a captured step the casts of weights from before the capture
    autocast = torch.autocast("cuda", dtype=compute_dtype, enabled=device.type == "cuda" and compute_dtype != torch.float32,
                              cache_enabled=not graph)
    tokens_per_step = tc.batch * mc.seq
    vals = val_batches(corpus, tc.val_batches, tc.batch, mc.seq)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def evaluate() -> float:
        total = torch.zeros((), device=device)
        with torch.no_grad(), autocast:
            for window in vals:
                x, y, pos0 = _shard(window, rank, world, device)
                total += net(x, y, pos0).float()
        dist.all_reduce(total)
        return float(total) / (len(vals) * tokens_per_step)

    def train_step(x: torch.Tensor, y: torch.Tensor, pos0: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step on this rank's shard: (the global mean loss, the gradient norm)."""
        with autocast:
            loss = net(x, y, pos0) / tokens_per_step  # this rank's share of the global mean
        loss.backward()
        allreduce_sequence_parallel_grads([net])
        norm = global_grad_norm(net)
        _clip_(net, norm, tc.clip)
        opt.step()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        return total, norm

    def set_lr(step: int) -> None:
        for group in opt.param_groups:
            if graph:
                group["lr"].fill_(lr_at(step, tc))  # the tensor the captured step reads
            else:
                group["lr"] = lr_at(step, tc)

    static: dict[str, Any] = {}  # graph mode: the captured step, its inputs and outputs
    side = torch.cuda.Stream(device) if graph else None

    def graph_step(step: int, x: torch.Tensor, y: torch.Tensor, pos0: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Eager (on a side stream, as torch's capture recipe warms up) for the first GRAPH_WARMUP
        steps, then captured once and replayed: every step is a real one, none repeated."""
        if step < GRAPH_WARMUP:
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                out = train_step(x, y, pos0)
                opt.zero_grad(set_to_none=True)  # the captured backward then writes fresh gradients
            torch.cuda.current_stream(device).wait_stream(side)
            return out
        if not static:
            static.update(x=x.clone(), y=y.clone(), graph=torch.cuda.CUDAGraph())
            with torch.cuda.graph(static["graph"]):
                static["out"] = train_step(static["x"], static["y"], pos0)
        static["x"].copy_(x)
        static["y"].copy_(y)
        static["graph"].replay()
        return static["out"]

    losses, times, grad_norms, val_loss = [], [], [], {}
    evals = set(eval_steps(tc))
    for step in range(tc.steps):
        window = train_batch(corpus, step, tc.batch, mc.seq, tc.seed)
        sync()
        began = time.perf_counter()
        x, y, pos0 = _shard(window, rank, world, device)
        set_lr(step)
        if graph:
            total, norm = graph_step(step, x, y, pos0)
        else:
            total, norm = train_step(x, y, pos0)
            opt.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - began)
        losses.append(float(total))
        grad_norms.append(float(norm))
        if not math.isfinite(losses[-1]):
            raise FloatingPointError(f"loss is {losses[-1]} at step {step}")
        if step in evals:
            val_loss[step] = evaluate()

    result: dict[str, Any] = {"loss": losses, "step_s": times, "grad_norm": grad_norms,
                              "val_loss": {str(k): v for k, v in val_loss.items()}, "data": corpus.info()}
    if backend == "device":
        cc._backend("device").close()  # type: ignore[attr-defined]
    if reference_steps:
        result["reference_loss"] = _train_reference(mc, tc, ref_state, corpus, reference_steps)
    return result if rank == 0 else {"loss": losses}


def _optimizer(model: torch.nn.Module, tc: TrainConfig, capturable: bool = False) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (both the TP model and its single-process yardstick);
    `capturable`: its CUDA-graph form, the learning rate a tensor on the parameters' device."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    lr: float | torch.Tensor = tc.lr
    if capturable:
        lr = torch.tensor(tc.lr, device=next(model.parameters()).device)
    return torch.optim.AdamW([{"params": decay, "weight_decay": tc.weight_decay},
                              {"params": other, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95),
                             capturable=capturable)


def _clip_(model: torch.nn.Module, norm: torch.Tensor, clip: float) -> None:
    """Scale the gradients so their global norm (`norm`, already summed over ranks) is at most `clip`."""
    if clip <= 0:
        return
    scale = torch.clamp(clip / (norm + 1e-6), max=1.0)
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(scale)


def _train_reference(mc: ModelConfig, tc: TrainConfig, state: dict, corpus: Corpus, steps: int) -> list[float]:
    """The same training loop on one process, full sequence, FP32, CPU: the TP model's yardstick."""
    ref = GPT(mc)
    ref.load_state_dict(state)
    opt = _optimizer(ref, tc)
    out = []
    for step in range(steps):
        window = train_batch(corpus, step, tc.batch, mc.seq, tc.seed)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, tc)
        loss = ref(window[:-1], window[1:]) / (tc.batch * mc.seq)
        loss.backward()
        norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in ref.parameters() if p.grad is not None))
        _clip_(ref, norm, tc.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(loss.item())
    return out


# -- driver ------------------------------------------------------------------------------------

def relative_difference(a: float, b: float) -> float:
    """|a - b| / |b|: compressed vs plain."""
    return abs(a - b) / abs(b)


def summarize(plain: dict, taco: dict, window: int = 10) -> dict[str, Any]:
    """Final losses (mean of the last `window` train steps; last validation), their relative
    differences, median step times (first 10% of steps skipped as warm-up)."""
    def tail(xs: list[float]) -> float:
        xs = xs[-min(window, len(xs)):]
        return sum(xs) / len(xs)

    def median_step(ts: list[float]) -> float:
        skip = len(ts) // 10
        rest = sorted(ts[skip:] or ts)
        return rest[len(rest) // 2]

    last_val = max(plain["val_loss"], key=int)
    out = {
        "final_train_loss": {"plain": tail(plain["loss"]), "taco": tail(taco["loss"])},
        "final_val_loss": {"plain": plain["val_loss"][last_val], "taco": taco["val_loss"][last_val]},
        "median_step_s": {"plain": median_step(plain["step_s"]), "taco": median_step(taco["step_s"])},
    }
    out["final_train_rel_diff"] = relative_difference(out["final_train_loss"]["taco"], out["final_train_loss"]["plain"])
    out["final_val_rel_diff"] = relative_difference(out["final_val_loss"]["taco"], out["final_val_loss"]["plain"])
    out["goal_met"] = out["final_val_rel_diff"] <= 0.005  # issue 5: within 0.5 %
    out["step_time_ratio_taco_over_plain"] = out["median_step_s"]["taco"] / out["median_step_s"]["plain"]
    return out


def plot(plain: dict, taco: dict, title: str, path: Path, dtype: str = "bfloat16") -> Path:
    """Both loss curves (train per step, validation points) in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for label, run, color in ((f"plain ({dtype} collectives)", plain, "tab:blue"), ("TACO FP8 (fwd + grad)", taco, "tab:orange")):
        ax.plot(range(len(run["loss"])), run["loss"], color=color, lw=1, alpha=0.8, label=f"{label} train")
        steps = sorted(run["val_loss"], key=int)
        ax.plot([int(s) for s in steps], [run["val_loss"][s] for s in steps], "o--", color=color, label=f"{label} val")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run_both(pool: Any, model: dict, train: dict, backend: str, dtype: str, timeout_s: float,
             graph: bool = False) -> tuple[dict, dict]:
    """Plain, then TACO, in the same pool: same seed, same batches."""
    job = f"{Path(__file__).stem}:train_job"  # workers import this module by name (bench/ on sys.path)
    runs = []
    for compress in (False, True):
        result = pool.run(job, timeout_s=timeout_s, model=model, train=train, compress=compress, backend=backend,
                          dtype=dtype, graph=graph)
        if not result.ok:
            failure = result.first_failure()
            raise RuntimeError(f"training (compress={compress}) failed: {result.status}: "
                               f"{failure.traceback or failure.message if failure else ''}")
        runs.append(result.values[0])
    return runs[0], runs[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = p.add_mutually_exclusive_group()
    where.add_argument("--gpus", type=int, help="GPU ranks (default 4 when --cpu-ranks is not given)")
    where.add_argument("--cpu-ranks", type=int, help="CPU ranks over gloo instead of GPUs")
    p.add_argument("--tiny", action="store_true", help="CPU preset: 2 layers, hidden 64, 4 heads, seq 64, batch 4, 10 steps")
    p.add_argument("--steps", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--hidden", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--batch", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--untied", action="store_true", help="separate LM head instead of the tied embedding")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--backend", choices=("reference", "device"), default="reference",
                   help="compressed collectives: host reference, or device-initiated (CUDA only)")
    p.add_argument("--graph", action="store_true",
                   help="with --backend device: each step (both runs) one CUDA graph replay after a few eager steps, "
                        "so step times compare GPU time, not the host's launches")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), help="compute/communication dtype (GPU default bf16; CPU fp32)")
    p.add_argument("--max-bytes", type=int, help="read only this many bytes of the stdlib")
    p.add_argument("--job-timeout", type=float, default=3600.0)
    p.add_argument("--out-dir", type=Path, default=Path("bench/results"))
    args = p.parse_args(argv)
    tiny = {"layers": 2, "hidden": 64, "heads": 4, "seq": 64, "batch": 4, "steps": 10, "lr": 3e-3}
    full = {"layers": 6, "hidden": 1024, "heads": 16, "seq": 1024, "batch": 8, "steps": 300, "lr": 6e-4}
    for key, value in (tiny if args.tiny else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.cpu_ranks is None and args.gpus is None:
        args.gpus = 4
    if args.backend == "device" and args.cpu_ranks is not None:
        p.error("--backend device needs CUDA (--gpus)")
    if args.graph and args.backend != "device":
        p.error("--graph needs --backend device")
    if args.dtype is None:
        args.dtype = "float32" if args.cpu_ranks is not None else "bfloat16"
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from commweave.report.results import write_results
    from commweave.runtime import WorkerPool, apply_safe_env

    args = parse_args(argv)
    apply_safe_env()  # NVLS off here too (the pool forces it into its workers' env as well)
    on_cpu = args.cpu_ranks is not None
    world = args.cpu_ranks if on_cpu else args.gpus
    model = asdict(ModelConfig(layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq,
                               tied=not args.untied))
    warmup = max(1, min(30, args.steps // 10))
    train = asdict(TrainConfig(steps=args.steps, batch=args.batch, lr=args.lr, warmup=warmup, seed=args.seed,
                               max_bytes=args.max_bytes))
    env = {"PYTHONPATH": os.pathsep.join(sys.path)}  # this script's directory: workers import it by name
    with WorkerPool(world, device="cpu" if on_cpu else "cuda", job_timeout_s=args.job_timeout, env=env) as pool:
        plain, taco = run_both(pool, model, train, args.backend, args.dtype, args.job_timeout, args.graph)
    summary = summarize(plain, taco)
    size = "" if (args.layers, args.hidden) == (6, 1024) else f"-{args.layers}x{args.hidden}"  # non-default: in the names
    name = f"taco-train-{world}{'cpu' if on_cpu else 'gpu'}{size}{'-graph' if args.graph else ''}"
    config = {"world": world, "device": "cpu" if on_cpu else "cuda", "backend": args.backend,
              "graph": args.graph,
              "dtype": args.dtype,
              "model": model, "train": train, "compression": "QuantConfig() forward and gradient, every TP layer",
              "parallelism": f"tensor parallel {world}, sequence parallel"}
    png = plot(plain, taco, f"{name}: {args.layers}x{args.hidden}, seq {args.seq}, batch {args.batch}, "
               f"{args.backend} collectives", args.out_dir / f"{name}.png", args.dtype)
    path = write_results(name, {"config": config, "summary": summary, "data": plain["data"],
                                "plain": {k: plain[k] for k in ("loss", "val_loss", "step_s", "grad_norm")},
                                "taco": {k: taco[k] for k in ("loss", "val_loss", "step_s", "grad_norm")},
                                "plot": str(png)},
                         command=[sys.executable, *([__file__, *argv] if argv is not None else sys.argv)],
                         out_dir=args.out_dir)
    print(json.dumps(summary, indent=2))
    print(f"final val loss: plain {summary['final_val_loss']['plain']:.4f}, taco {summary['final_val_loss']['taco']:.4f}, "
          f"relative difference {100 * summary['final_val_rel_diff']:.3f} % (goal <= 0.5 %: "
          f"{'met' if summary['goal_met'] else 'NOT met'})")
    print(f"final train loss (last 10 steps) relative difference {100 * summary['final_train_rel_diff']:.3f} %")
    print(f"median step: plain {1e3 * summary['median_step_s']['plain']:.1f} ms, "
          f"taco {1e3 * summary['median_step_s']['taco']:.1f} ms")
    print("results:", path, "plot:", png)
    return {"summary": summary, "results": str(path), "plot": str(png)}


if __name__ == "__main__":
    main()
