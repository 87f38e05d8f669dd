"""The source side every host baseline shares: one layer's stand-in prefill, then vLLM's
reshape_and_cache (the layer's new K/V into its pages, a partial last page zero-padded)."""

from __future__ import annotations

import torch

PAGE_TOKENS = 16


class PrefillLayers:
    """Buffers for `layer(...)`: the GEMMs' scratch output and the partial last page."""

    def __init__(self, shape, device: torch.device):
        self.passes = shape["P"]
        self.scratch = torch.empty(shape["S"], 4096, dtype=torch.bfloat16, device=device) if self.passes else None
        self.tail = torch.zeros(2, 1, PAGE_TOKENS, shape["KV"], shape["D"], dtype=torch.bfloat16, device=device)

    def layer(self, inputs: dict[str, torch.Tensor], cache: torch.Tensor, layer: int) -> None:
        """P GEMMs [S, 4096] x [4096, 4096], then layer `layer`'s K/V into pages src_blocks of `cache`."""
        for _ in range(self.passes):
            torch.matmul(inputs["x"], inputs["w"], out=self.scratch)
        kv, blocks = inputs["kv"], inputs["src_blocks"]
        tokens, full = kv.shape[2], kv.shape[2] // PAGE_TOKENS
        if full:
            pages = kv[layer, :, :full * PAGE_TOKENS].reshape(2, full, PAGE_TOKENS, kv.shape[3], kv.shape[4])
            cache[layer].index_copy_(1, blocks[:full], pages)
        if tokens % PAGE_TOKENS:
            self.tail[:, 0, :tokens % PAGE_TOKENS] = kv[layer, :, full * PAGE_TOKENS:]
            cache[layer].index_copy_(1, blocks[full:], self.tail)
