"""One GPU, no communication: what the attention-cp seed's parts cost at the bench shapes' per-rank
sizes, so the seed's knobs and the issue's "ideal" can be set from measurements.

For each (S, W, heads, D, causal) it times, with CUDA events (median of --iters after warm-up):
the ideal (this rank's queries over all S keys: SDPA, as the all-gather baseline computes it),
each block-attention backend (cudnn, flash; KV repeated or native GQA) on the seed's local and
remote blocks, and the fused merge. Writes a results JSON (report.results.write_results).

    python bench/probe_attention.py --out-dir bench/results
"""

from __future__ import annotations


import torch
import torch.nn.functional as F

from commweave.runtime.timers import cuda_median_us as median_us
from probe_cli import probe_main  # bench/ is on sys.path when a probe runs as a script
from commweave.workloads.attention_cp.attention import attention_with_lse, merge_two

CASES = [(32768, 4, 32, 8, 128, False), (32768, 2, 32, 8, 128, False), (131072, 4, 32, 8, 128, False),
         (32768, 4, 32, 8, 128, True)]


def _probe(seq: int, world: int, hq: int, hkv: int, d: int, causal: bool, iters: int) -> dict[str, float | str]:
    local = seq // world
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(local, hq, d, device="cuda", generator=gen).bfloat16()
    k = torch.randn(seq, hkv, d, device="cuda", generator=gen).bfloat16()
    v = torch.randn_like(k)
    row: dict[str, float | str] = {"case": f"s{seq}-w{world}-q{hq}kv{hkv}-d{d}-{'causal' if causal else 'full'}"}
    # the ideal: SDPA of this rank's queries over every visible key (non-causal: all of them)
    qs, ks, vs = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    if not causal:
        row["ideal_sdpa_us"] = median_us(lambda: F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True), iters)
    flops = 4 * local * (seq if not causal else seq / 2) * hq * d
    remote = k[local:], v[local:]
    for backend in ("cudnn", "flash"):
        for native in (False, True):
            name = f"{backend}{'_gqa' if native else '_repeat'}"
            try:
                row[f"{name}_local_us"] = median_us(lambda: attention_with_lse(q, k[:local], v[:local], causal=causal, backend=backend, native_gqa=native), iters)
                row[f"{name}_remote_us"] = median_us(lambda: attention_with_lse(q, *remote, backend=backend, native_gqa=native), iters)
            except RuntimeError as exc:
                row[f"{name}_error"] = str(exc).splitlines()[0][:200]
    o_a, lse_a = attention_with_lse(q, k[:local], v[:local])
    o_b, lse_b = attention_with_lse(q, *remote)
    out = torch.empty_like(q)
    row["merge_us"] = median_us(lambda: merge_two(out, o_a, lse_a, o_b, lse_b), iters)
    row["flops"] = flops
    return row


def main() -> None:
    probe_main(__doc__, "probe-attention-blocks-1gpu", "per-rank attention pieces on one GPU, µs", CASES, _probe)


if __name__ == "__main__":
    main()
