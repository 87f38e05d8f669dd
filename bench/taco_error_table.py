"""Figure: TACO's error table (docs/results.md; bench/results/taco-error-table.md), CPU only.

Relative error of FP8 group quantization against the BF16 tensor.

    python bench/taco_error_table.py [--steps 300] [--threads 2]

Tensors (each cast to BF16 first; the BF16 tensor is the reference and the quantizer's input):
  gaussian       N(0, 1), 2^20 elements
  student_t      Student-t (3 degrees of freedom) with 0.05% of elements multiplied by 100
  token_scaled   Gaussian tokens of width 128 whose scales spread log-uniformly over 1e-5..1
                 (per-token magnitudes that differ by orders, as across a batch's tokens)
  ln_act         post-LayerNorm activations of a tiny GPT (what a sequence-parallel column-parallel
                 Linear all-gathers forward)
  ln_grad        gradients w.r.t. those activations (what its backward reduce-scatters)
  proj_grad      gradients w.r.t. the attention / MLP output projections' outputs (what a
                 row-parallel Linear all-gathers backward)
The model tensors come from a byte-level GPT (4 layers, width 128, 4 heads, context 128) trained
on CPU for --steps steps on the Python standard library's own source files (real text, offline),
captured on a held-out batch after training.

Configurations: FP8 E4M3 and E5M2, G in {32, 128, 512}, Hadamard on/off/adaptive, dual scales on/off, and
(with Hadamard) the transform's input rounded to FP16 as a tensor-core kernel would; baselines: a
plain FP8 cast with one per-tensor absmax scale, and a raw cast without any scale.
Error: ||deq - x||_2 / ||x||_2 with x the BF16 tensor, deq decompressed in FP32; also the same over
the 99% of elements smallest in magnitude ("bulk99"), since the whole-tensor norm is dominated by
the largest elements; and the 90th percentile over tokens (128 contiguous elements) of each token's
own relative error ("token_p90"), which shows what happens to tokens much smaller than the rest.

Writes bench/results/taco-error-table-<UTC>.json (with provenance) and bench/results/taco-error-table.md.
"""

from __future__ import annotations

import argparse
import glob
import itertools
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

from commweave.report.results import RESULTS_DIR, write_results
from commweave.taco.quant import QuantConfig, compress, decompress, plain_fp8_cast

FORMATS = ["e4m3", "e5m2"]
GROUPS = [32, 128, 512]
TENSORS = ["gaussian", "student_t", "token_scaled", "ln_act", "ln_grad", "proj_grad"]
MAX_ELEMENTS = 1 << 20
TOKEN = 128  # the model's width: one token's hidden vector


# -- a tiny GPT on the standard library's source ------------------------------------------------

def stdlib_text() -> tuple[bytes, list[str]]:
    root = os.path.dirname(os.__file__)
    files = sorted(glob.glob(os.path.join(root, "*.py")))  # top level only: no site-packages
    return b"\n".join(Path(f).read_bytes() for f in files), [os.path.basename(f) for f in files]


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.taps: dict[str, list[torch.Tensor]] | None = None

    def _tap(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if self.taps is not None:
            self.taps.setdefault(name, []).append(t.detach().clone())
            t.register_hook(lambda g: self.taps.setdefault(name + "_grad", []).append(g.detach().clone()))
        return t

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = self._tap("ln", self.ln1(x))
        q, k, v = self.qkv(h).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = x + self._tap("proj", self.proj(a))
        h = self._tap("ln", self.ln2(x))
        return x + self._tap("proj", self.fc2(nn.functional.gelu(self.fc1(h))))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 256, d: int = 128, layers: int = 4, heads: int = 4, ctx: int = 128):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def train_and_capture(steps: int, batch: int = 8, ctx: int = 128, seed: int = 0) -> tuple[dict[str, torch.Tensor], dict]:
    torch.manual_seed(seed)
    text, files = stdlib_text()
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    split = int(0.95 * data.numel())
    train, held = data[:split], data[split:]
    model = TinyGPT(ctx=ctx)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps, pct_start=0.1)

    def batch_of(src: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, src.numel() - ctx - 1, (batch,), generator=gen)
        rows = torch.stack([src[i:i + ctx + 1] for i in starts.tolist()])
        return rows[:, :-1], rows[:, 1:]

    gen = torch.Generator().manual_seed(seed)
    losses = []
    began = time.time()
    for _ in range(steps):
        x, y = batch_of(train, gen)
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
    train_s = time.time() - began

    taps: dict[str, list[torch.Tensor]] = {}
    for blk in model.blocks:
        blk.taps = taps
    x, y = batch_of(held, torch.Generator().manual_seed(seed + 1))
    held_loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    model.zero_grad(set_to_none=True)
    held_loss.backward()
    for blk in model.blocks:
        blk.taps = None
    # activations as a TP layer sees them: sequence first, [s, b, d], hidden contiguous
    tensors = {
        "ln_act": torch.cat([t.transpose(0, 1).reshape(-1) for t in taps["ln"]])[:MAX_ELEMENTS],
        "ln_grad": torch.cat([t.transpose(0, 1).reshape(-1) for t in taps["ln_grad"]])[:MAX_ELEMENTS],
        "proj_grad": torch.cat([t.transpose(0, 1).reshape(-1) for t in taps["proj_grad"]])[:MAX_ELEMENTS],
    }
    info = {
        "model": "byte-level GPT, 4 layers, width 128, 4 heads, context 128, pre-LayerNorm",
        "params": sum(p.numel() for p in model.parameters()),
        "data": f"{len(files)} top-level .py files of the Python {sys.version.split()[0]} standard library "
                f"({len(text)} bytes), last 5% held out",
        "steps": steps, "batch": batch, "optimizer": "AdamW lr 3e-3 one-cycle, clip 1.0",
        "train_loss_first": losses[0], "train_loss_last10_mean": sum(losses[-10:]) / 10,
        "held_out_loss": held_loss.item(), "train_seconds": round(train_s, 1),
        "loss_every_25_steps": [round(v, 4) for v in losses[::25]],
    }
    return tensors, info


# -- the table -------------------------------------------------------------------------------------

def synthetic(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    gaussian = torch.randn(MAX_ELEMENTS, generator=gen)
    chi2 = torch.randn(3, MAX_ELEMENTS, generator=gen).square().sum(0) / 3  # Student-t, 3 d.o.f.
    t = torch.randn(MAX_ELEMENTS, generator=gen) / chi2.sqrt()
    outliers = torch.randperm(MAX_ELEMENTS, generator=gen)[: MAX_ELEMENTS // 2000]
    t[outliers] *= 100.0
    token_scale = 10.0 ** (-5.0 * torch.rand(MAX_ELEMENTS // 128, 1, generator=gen))
    token_scaled = (torch.randn(MAX_ELEMENTS // 128, 128, generator=gen) * token_scale).reshape(-1)
    return {"gaussian": gaussian, "student_t": t, "token_scaled": token_scaled}


def rel_err(deq: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    ref64, deq64 = ref.double(), deq.double()
    if mask is not None:
        ref64, deq64 = ref64[mask], deq64[mask]
    return float((deq64 - ref64).norm() / ref64.norm())


def token_p90(deq: torch.Tensor, ref: torch.Tensor) -> float:
    """90th percentile over tokens (128 contiguous elements) of each token's own relative error:
    what the norm-based errors hide for tokens much smaller than the rest."""
    r = ref.double().reshape(-1, TOKEN)
    e = (deq.double().reshape(-1, TOKEN) - r).norm(dim=1)
    n = r.norm(dim=1)
    return float((e[n > 0] / n[n > 0]).quantile(0.9))


def bulk_mask(ref: torch.Tensor) -> torch.Tensor:
    """The 99% of elements smallest in magnitude: the norm-relative error is dominated by the largest
    elements, this one shows what happens to the rest."""
    mag = ref.float().abs().reshape(-1)
    k = max(1, int(0.99 * mag.numel()))
    return (mag <= mag.kthvalue(k).values).view(ref.shape)


def stats(x: torch.Tensor) -> dict:
    xf = x.double()
    rms = float(xf.square().mean().sqrt())
    return {"numel": x.numel(), "rms": rms, "absmax": float(xf.abs().max()),
            "absmax_over_rms": float(xf.abs().max()) / rms,
            "kurtosis": float((xf - xf.mean()).pow(4).mean() / xf.var(unbiased=False) ** 2),
            "frac_below_1e-3_rms": float((xf.abs() < 1e-3 * rms).double().mean())}


def configs() -> list[dict]:
    out = []
    for fmt, g, h, d in itertools.product(FORMATS, GROUPS, [False, True, "adaptive"], [False, True]):
        out.append(dict(fmt=fmt, group_size=g, hadamard=h, dual_scale=d, transform_input="fp32"))
        if h is True:
            out.append(dict(fmt=fmt, group_size=g, hadamard=h, dual_scale=d, transform_input="fp16"))
    return out


def measure(tensors: dict[str, torch.Tensor]) -> list[dict]:
    rows = []
    refs = {name: t.bfloat16() for name, t in tensors.items()}
    masks = {name: bulk_mask(ref) for name, ref in refs.items()}

    def errors(row: dict, name: str, deq: torch.Tensor) -> None:
        row[name] = rel_err(deq, refs[name].float())
        row[name + "_bulk99"] = rel_err(deq, refs[name].float(), masks[name])
        row[name + "_token_p90"] = token_p90(deq, refs[name].float())
    for fmt in FORMATS:
        for per_tensor in (True, False):
            row = {"method": "plain FP8 cast, per-tensor scale" if per_tensor else "raw FP8 cast, no scale",
                   "fmt": fmt, "wire_bytes_per_element": 1.0}
            for name, ref in refs.items():
                errors(row, name, plain_fp8_cast(ref.float(), fmt, per_tensor))
            rows.append(row)
    for c in configs():
        cfg = QuantConfig(c["group_size"], c["fmt"], hadamard=c["hadamard"], dual_scale=c["dual_scale"],
                          transform_input_dtype=torch.float16 if c["transform_input"] == "fp16" else torch.float32)
        row = {"method": "TACO group quantization", **c,
               "wire_bytes_per_element": cfg.wire_bytes(MAX_ELEMENTS) / MAX_ELEMENTS}
        for name, ref in refs.items():
            errors(row, name, decompress(compress(ref, cfg), torch.float32))
        rows.append(row)
    return rows


def _taco(g: int, h: bool, d: bool, t: str = "fp32"):
    return lambda r: (r["method"].startswith("TACO") and r["group_size"] == g and r["hadamard"] == h
                      and r["dual_scale"] == d and r["transform_input"] == t)


HEADLINE = [
    ("raw FP8 cast, no scale", lambda r: r["method"].startswith("raw")),
    ("plain FP8 cast, per-tensor scale", lambda r: r["method"].startswith("plain")),
    ("groups, one absmax scale, no Hadamard", _taco(128, False, False)),
    ("groups, dual scales, no Hadamard", _taco(128, False, True)),
    ("groups, Hadamard, one absmax scale", _taco(128, True, False)),
    ("groups, Hadamard, dual scales (TACO)", _taco(128, True, True)),
    ("groups, Hadamard, dual scales, FP16 transform input", _taco(128, True, True, "fp16")),
    ("groups, adaptive Hadamard (per group), dual scales", _taco(128, "adaptive", True)),
]


def markdown(rows: list[dict], info: dict, tstats: dict, json_name: str) -> str:
    lines = [
        "# TACO error table: relative error against BF16",
        "",
        f"From [`{json_name}`]({json_name}) (`python bench/taco_error_table.py`, CPU). Error = "
        "‖deq − x‖₂ / ‖x‖₂ with x the BF16 tensor (the quantizer's input), deq decompressed in FP32. "
        "H: Hadamard transform per group (adaptive: per group, whichever of on/off gives the lower L2 error, flagged in the scale's sign); dual: RMS pre-scale + absmax post-scale per group (else one "
        "absmax scale); T16: the transform's input rounded to FP16, as a tensor-core Hadamard kernel would. "
        "Bytes/elt: FP8 payload plus FP32 scales (BF16 is 2). In parentheses: the same error over the 99% of "
        "elements smallest in magnitude (the whole-tensor norm is dominated by the largest elements).",
        "",
        f"Model tensors: {info['model']}, {info['params']} parameters, trained {info['steps']} steps "
        f"(batch {info['batch']}) on {info['data']}; training loss {info['train_loss_first']:.2f} → "
        f"{info['train_loss_last10_mean']:.2f} (nats/byte), held-out {info['held_out_loss']:.2f}; "
        "tensors captured on a held-out batch.",
        "",
        "| tensor | elements | rms | absmax/rms | kurtosis |",
        "|---|---|---|---|---|",
    ]
    for name in TENSORS:
        s = tstats[name]
        lines.append(f"| {name} | {s['numel']} | {s['rms']:.3g} | {s['absmax_over_rms']:.1f} | {s['kurtosis']:.1f} |")
    lines += ["", "## Headline: G = 128", "",
              "| fmt | method | " + " | ".join(TENSORS) + " |", "|---|---|" + "---|" * len(TENSORS)]
    for fmt in FORMATS:
        for label, pick in HEADLINE:
            r = next(r for r in rows if r["fmt"] == fmt and pick(r))
            lines.append(f"| {fmt.upper()} | {label} |" + "".join(f" {r[name]:.4f} ({r[name + '_bulk99']:.4f}) |" for name in TENSORS))
    lines += ["", "Per token (128 contiguous elements, one hidden vector): each token's own relative error, "
              "90th percentile over tokens, G = 128:", "",
              "| fmt | method | " + " | ".join(TENSORS) + " |", "|---|---|" + "---|" * len(TENSORS)]
    for fmt in FORMATS:
        for label, pick in HEADLINE:
            r = next(r for r in rows if r["fmt"] == fmt and pick(r))
            lines.append(f"| {fmt.upper()} | {label} |" + "".join(f" {r[name + '_token_p90']:.4f} |" for name in TENSORS))
    for fmt in FORMATS:
        lines += ["", f"## {fmt.upper()}", "",
                  "| method | G | H | dual | T16 | bytes/elt | " + " | ".join(TENSORS) + " |",
                  "|---|---|---|---|---|---|" + "---|" * len(TENSORS)]
        for r in rows:
            if r["fmt"] != fmt:
                continue
            if r["method"].startswith("TACO"):
                hada = {True: "on", False: "off", "adaptive": "adaptive"}[r["hadamard"]]
                head = (f"| TACO | {r['group_size']} | {hada} | "
                        f"{'on' if r['dual_scale'] else 'off'} | {'on' if r['transform_input'] == 'fp16' else ''} | "
                        f"{r['wire_bytes_per_element']:.3f} |")
            else:
                head = f"| {r['method']} | | | | | 1.000 |"
            lines.append(head + "".join(f" {r[name]:.4f} ({r[name + '_bulk99']:.4f}) |" for name in TENSORS))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    began = time.time()
    model_tensors, info = train_and_capture(args.steps)
    tensors = {**synthetic(), **model_tensors}
    tensors = {name: tensors[name] for name in TENSORS}
    tstats = {name: stats(t.bfloat16().float()) for name, t in tensors.items()}
    rows = measure(tensors)
    payload = {"tensors": tstats, "model": info, "rows": rows, "seconds": round(time.time() - began, 1),
               "metric": "||deq - x|| / ||x||, x = BF16 tensor, deq in FP32; *_bulk99: over the 99% of elements smallest in |x|; *_token_p90: 90th percentile over 128-element tokens of each token's relative error"}
    cmd = ["python", "bench/taco_error_table.py", *(argv if argv is not None else sys.argv[1:])]
    path = write_results("taco-error-table", payload, command=cmd)
    md = Path(RESULTS_DIR) / "taco-error-table.md"
    md.write_text(markdown(rows, info, tstats, path.name))
    print(f"wrote {path} and {md} in {time.time() - began:.0f} s")
    return path


if __name__ == "__main__":
    main()
