"""Context-parallel attention's backward on one GPU (`-m gpu`; needs 1 CUDA GPU, no process group):
the fused block backward (the global out and LSE handed to cuDNN's backward kernel, GQA native,
or torch's flash backward kernel, K/V repeated for GQA) against the float32 block math, the ring forward and backward at W = 1 and the
module at W = 1 against float32 autograd, the module's W = 1 path running SDPA's flash kernel."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend, sdpa_kernel

from attention_train_jobs import full_data, reference
from commweave.nn import ContextParallelAttention
from commweave.workloads.attention_cp.attention import attention_backward_block
from commweave.workloads.attention_cp.ring import ring_backward, ring_forward

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 1 or dist.is_initialized(),
                                                  reason="needs 1 CUDA GPU (and no process group)")]
TOLERANCE = 2e-2  # bf16 against float32


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def _cuda(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.cuda() for t in tensors]


@pytest.mark.parametrize("backend", ["cudnn", "flash"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads,dim", [((8, 2), 128), ((4, 4), 64), ((8, 2), 40)])
def test_fused_block_backward_matches_float32(backend: str, causal: bool, heads: tuple[int, int], dim: int) -> None:
    q, k, v, g = _cuda(*full_data(1, 256, heads[0], heads[1], dim))
    out, lse = ring_forward(q, k, v, causal, False, None)
    want = attention_backward_block(g[0], q[0], k[0], v[0], out[0], lse[0], causal=causal, backend="torch")
    got = attention_backward_block(g[0].bfloat16(), q[0], k[0], v[0], out[0], lse[0], causal=causal, backend=backend)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert a.dtype == torch.float32 and a.shape == b.shape
        assert _rel(a, b) < TOLERANCE, name


@pytest.mark.parametrize("causal", [False, True])
def test_ring_and_module_at_one_rank_match_autograd(causal: bool) -> None:
    """batch 2, 512 tokens, 8 query heads over 2 KV heads, D 128: the ring's cuDNN/flash blocks and
    the module (SDPA, flash only: it raises if flash cannot take the call) against float32."""
    q, k, v, g = full_data(2, 512, 8, 2, 128)
    want = reference(q, k, v, g, causal)
    q, k, v, g = _cuda(q, k, v, g)
    out, lse = ring_forward(q, k, v, causal, causal, None)
    grads = ring_backward(g.bfloat16(), q, k, v, out, lse, causal, causal, None)
    for name, got in zip(("out", "dq", "dk", "dv"), (out, *grads)):
        assert _rel(got.cpu(), want[name]) < TOLERANCE, f"ring {name}"
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        o = ContextParallelAttention(causal=causal)(qg, kg, vg)
        (o.float() * g).sum().backward()
    for name, got in zip(("out", "dq", "dk", "dv"), (o.detach(), qg.grad, kg.grad, vg.grad)):
        assert _rel(got.cpu(), want[name]) < TOLERANCE, f"module {name}"
