"""TACO's CUDA kernels (commweave.taco.cuda) against the torch reference (quant.py).

CPU: every specialization class compiles for sm_90 with nvcc (no spills, no stack frame at the
defaults), and bad arguments are refused with the reason before any launch. GPU
(`pytest -m gpu tests/test_taco_cuda.py -s`): bit for bit against the reference (payload bytes,
scales, decompressed values with signed zeros) for every format, G, switch and dtype, gathering and
summing several messages; timed against the Triton kernels.
"""

from __future__ import annotations

import itertools
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from commweave.runtime.compile import compile_cubin
from commweave.taco import cuda, quant
from commweave.taco.quant import QuantConfig
from cuda_host import toolchain_or_skip
from taco_jobs import edge_inputs, gaussian, same_bits

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _compile_cases() -> list[tuple[QuantConfig, torch.dtype, int]]:
    """Every G, format, transform mode, scale mode, transform-input cast, I/O dtype and summed
    source count at least once."""
    cases = [(QuantConfig(g), torch.bfloat16, 2) for g in (32, 64, 128, 256, 512)]
    cases += [(QuantConfig(128, fmt, hadamard=h, dual_scale=d), torch.float32, 4)
              for fmt, h, d in itertools.product(["e4m3", "e5m2"], [False, True, "adaptive"], [False, True])]
    cases += [(QuantConfig(128, transform_input_dtype=t), dt, 3) for t, dt in [(torch.float16, torch.float16),
                                                                              (torch.bfloat16, torch.bfloat16)]]
    cases += [(QuantConfig(512, hadamard="adaptive"), torch.float32, 8), (QuantConfig(32, hadamard="adaptive"), torch.float16, 1)]
    return cases


def test_every_specialization_class_compiles_for_sm90():
    toolchain_or_skip()
    cases = _compile_cases()
    with ThreadPoolExecutor(8) as pool:
        logs = list(pool.map(lambda c: compile_cubin(cuda.specialization(*c)).log, cases))
    for (cfg, dtype, n), log in zip(cases, logs):
        frames = dict(zip(re.findall(r"Function properties for (\w+)", log),
                          [tuple(int(w) for w in re.findall(r"(\d+) bytes", line))
                           for line in log.splitlines() if "stack frame" in line]))
        assert set(frames) == {"taco_compress", "taco_gather", "taco_sum", "taco_sum_compress"}, log
        for kernel, frame in frames.items():
            # adaptive compression holds both transforms' values at once, and summing then compressing
            # holds a sum and the next message's bytes with compression's values: they may spill; the
            # summing kernel holds two messages in flight, and a gathering lane stages 128 bytes of
            # FP32 output under the tightest register budget (64): a few bytes at most
            if (kernel == "taco_compress" and cfg.hadamard == "adaptive") or kernel == "taco_sum_compress":
                continue
            limit = 16
            assert frame[1] <= limit and frame[2] <= limit, (cfg, dtype, n, frames)


def test_every_tuning_compiles_without_spills_at_the_defaults():
    """The tunings' other paths (16-bit fetch by loads or cp.async, no transposed layout) keep
    compiling, and at TACO's defaults the transposed layout's kernels keep their registers (no stack
    frame but sum-compress's)."""
    toolchain_or_skip()
    cases = [(cuda.Tuning(fetch16="async", transpose=False), torch.bfloat16),
             (cuda.Tuning(fetch16="load"), torch.bfloat16), (cuda.Tuning(), torch.float16),
             (cuda.Tuning(), torch.float32), (cuda.Tuning(), torch.bfloat16)]
    sources = []
    for tuning, dtype in cases:
        previous = cuda.set_tuning(tuning)
        try:
            sources.append(cuda.specialization(QuantConfig(128), dtype, 2))
        finally:
            cuda.set_tuning(previous)
    with ThreadPoolExecutor(len(sources)) as pool:
        logs = list(pool.map(lambda text: compile_cubin(text).log, sources))
    for (tuning, dtype), log in zip(cases, logs):
        frames = dict(zip(re.findall(r"Function properties for (\w+)", log),
                          [int(re.search(r"(\d+) bytes stack frame", line).group(1))
                           for line in log.splitlines() if "stack frame" in line]))
        assert set(frames) == {"taco_compress", "taco_gather", "taco_sum", "taco_sum_compress"}, log
        assert all(v == 0 for k, v in frames.items() if k != "taco_sum_compress"), (tuning, dtype, frames)


def test_tuning_sets_the_macros_and_the_grid(monkeypatch):
    """set_tuning recompiles with the tuning's macros; the persistent grid is the resident blocks at
    most (the kernel's launch bound where no driver occupancy is known), the legacy one 8 a SM;
    "auto" fetches by cp.async only where the transform is on."""
    monkeypatch.setattr(cuda, "_sm_count", lambda index: 132)
    previous = cuda.set_tuning(cuda.Tuning(fetch16="async", transpose=False))
    try:
        text = cuda.specialization(QuantConfig(), torch.bfloat16, 2)
        assert "#define TACO_FETCH16 1\n" in text and "#define TACO_TRANSPOSE 0\n" in text
        assert cuda._min_blocks_of(text, "taco_compress") == cuda.MIN_BLOCKS_PER_SM["compress"]
        assert cuda._min_blocks_of(text, "taco_sum_compress") == cuda.MIN_BLOCKS_PER_SM["sum"]
        assert cuda._resident_blocks(object(), 3) == 3  # not a driver function: the launch bound
        assert cuda._grid(0, 100_000, 2) == 264 and cuda._grid(0, 9, 2) == 2 and cuda._grid(0, 0, 2) == 1
        cuda.set_tuning(cuda.Tuning(persistent=False))
        assert cuda._grid(0, 100_000, 2) == 132 * 8
        text = cuda.specialization(QuantConfig(), torch.bfloat16, 2)
        assert "#define TACO_FETCH16 1\n" in text and "#define TACO_TRANSPOSE 1\n" in text
        plain = cuda.specialization(QuantConfig(hadamard=False), torch.bfloat16, 2)
        assert "#define TACO_FETCH16 0\n" in plain
    finally:
        cuda.set_tuning(previous)
    assert cuda.TUNING == previous
    with pytest.raises(ValueError, match="fetch16 must be one of load, async, auto, got 'tma'"):
        cuda.Tuning(fetch16="tma")



def test_specialization_refuses_what_the_kernels_do_not_take():
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        cuda.specialization(QuantConfig(), torch.float64)
    with pytest.raises(ValueError, match="1..8 messages"):
        cuda.specialization(QuantConfig(), torch.float32, 9)
    text = cuda.specialization(QuantConfig(64, "e5m2", hadamard="adaptive", dual_scale=False,
                                           transform_input_dtype=torch.bfloat16), torch.float16, 3)
    for macro in ("TACO_G 64", "TACO_FMT 1", "TACO_HADAMARD 2", "TACO_DUAL 0", "TACO_CAST 2", "TACO_IN 1",
                  "TACO_OUT 1", "TACO_NSRC 3"):
        assert f"#define {macro}\n" in text


def test_bad_arguments_are_refused_before_any_launch():
    cfg = QuantConfig()
    x = torch.randn(4, 256)
    buf = torch.empty(cfg.wire_bytes(x.numel()), dtype=torch.uint8)
    with pytest.raises(TypeError, match="float64"):
        cuda.compress_into(x.double(), cfg, buf)
    with pytest.raises(ValueError, match="3 equal chunks"):
        cuda.compress_into(x, cfg, buf, segments=3)
    with pytest.raises(ValueError, match=r"skip must be a chunk index in 0..1"):
        cuda.compress_into(x, cfg, torch.empty(2 * cfg.packed_stride(512), dtype=torch.uint8), segments=2, skip=2)
    with pytest.raises(ValueError, match="uint8 tensor of 1088 bytes for 2 message"):
        cuda.compress_into(x, cfg, buf[:-4], segments=2)
    with pytest.raises(ValueError, match="max_blocks must be at least 1"):
        cuda.compress_into(x, cfg, buf, max_blocks=0)
    with pytest.raises(ValueError, match="own_out must be a contiguous torch.float32 tensor of 1024 elements"):
        cuda.compress_into(x, cfg, buf, own_out=torch.empty(1000))
    with pytest.raises(ValueError, match="and x one message"):
        cuda.compress_into(x, cfg, torch.empty(2 * cfg.packed_stride(512), dtype=torch.uint8), segments=2,
                           own_out=torch.empty(512))
    with pytest.raises(ValueError, match="need CUDA tensors"):
        cuda.compress_into(x, cfg, buf)
    with pytest.raises(ValueError, match="need CUDA tensors"):
        quant.compress(x, cfg, impl="cuda")
    with pytest.raises(ValueError, match="impl must be 'reference', 'triton' or 'cuda'"):
        quant.compress(x, cfg, impl="cutlass")
    c = quant.compress(x, cfg)  # separate tensors, not one packed buffer
    with pytest.raises(ValueError, match="packed messages"):
        cuda.gather_into([c], torch.empty(x.numel()))
    packed = quant.packed_view(quant.pack(c), x.shape, x.dtype, cfg)
    other = quant.packed_view(quant.pack(quant.compress(x[:2], cfg)), x[:2].shape, x.dtype, cfg)
    with pytest.raises(ValueError, match="same config and size"):
        cuda.sum_into([packed, other], torch.empty(x.numel()))
    with pytest.raises(ValueError, match="1..8 messages"):
        cuda.sum_into([packed] * 9, torch.empty(x.numel()))
    with pytest.raises(ValueError, match="requantizes with the messages' config"):
        cuda.sum_compress_into([packed], torch.float32, QuantConfig(64), torch.empty(0, dtype=torch.uint8))
    with pytest.raises(ValueError, match="own_out must be a contiguous torch.float32 tensor of 1024 elements"):
        cuda.sum_compress_into([packed], torch.float32, cfg, torch.empty(cfg.wire_bytes(1024), dtype=torch.uint8),
                               own_out=torch.empty(1024, dtype=torch.float16))
    with pytest.raises(ValueError, match="at most one raw tensor"):
        cuda.sum_into([packed, x, x], torch.empty(x.numel()))
    with pytest.raises(ValueError, match="raw part must be a contiguous torch.float32 tensor of 1024 elements"):
        cuda.sum_into([packed, x.half()], torch.empty(x.numel()))
    with pytest.raises(ValueError, match="out must be a contiguous tensor of 2048 elements"):
        cuda.gather_into([packed, packed], torch.empty(x.numel()))
    with pytest.raises(ValueError, match=r"skip must be a message index in 0..1"):
        cuda.gather_into([packed, packed], torch.empty(2 * x.numel()), skip=2)
    with pytest.raises(TypeError, match="decompress to float32"):
        cuda.sum_into([packed], torch.empty(x.numel(), dtype=torch.float64))
    with pytest.raises(ValueError, match="must be a CUDA tensor on the messages' device"):
        cuda.sum_into([packed], torch.empty(x.numel()))


def test_a_message_layout_is_checked_once_and_again_when_its_tensors_change():
    """A packed view's layout check is remembered on the view (the collectives pass the same views
    every call); replacing one of its tensors makes the next use check it again."""
    cfg = QuantConfig()
    buf = torch.empty(cfg.wire_bytes(1024) + 16, dtype=torch.uint8)
    start = (-buf.data_ptr()) % 16
    packed = quant.packed_view(buf[start:start + cfg.wire_bytes(1024)], (1024,), torch.float32, cfg)
    assert packed.packed_check is None
    address = cuda._packed_address(packed)
    assert address == packed.payload.data_ptr() and packed.packed_check[4] == address
    assert cuda._packed_address(packed) == address
    packed.scale = packed.scale.clone()  # no longer right after the payload
    with pytest.raises(ValueError, match="packed messages"):
        cuda._packed_address(packed)


# -- GPU ------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _gpu_configs() -> list[QuantConfig]:
    configs = [QuantConfig(g, fmt, hadamard=h, dual_scale=d)
               for fmt, g, h, d in itertools.product(["e4m3", "e5m2"], [32, 128, 512], [False, True, "adaptive"],
                                                     [False, True])]
    configs += [QuantConfig(g) for g in (64, 256)]
    configs += [QuantConfig(128, hadamard=h, dual_scale=d, transform_input_dtype=t)
                for h, d, t in itertools.product([True, "adaptive"], [False, True], [torch.float16, torch.bfloat16])]
    return configs


def _precompile(configs: list[QuantConfig], sums: int) -> None:
    """Every cubin the check launches, compiled in parallel first (one nvcc each, ~2 s)."""
    sources = {cuda.specialization(cfg, dtype, n) for cfg in configs for dtype in DTYPES for n in (1, sums)}
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(compile_cubin, sources))


def _inputs(cfg: QuantConfig) -> list[torch.Tensor]:
    x = gaussian((37, 129), seed=1)  # ragged: the last group padded
    edges = edge_inputs()
    if cfg.hadamard and not cfg.dual_scale:  # single scale + transform: finite only for |x| <= FP32_MAX / G
        edges = edges[: 5 * 2048]
    return [x, x.bfloat16(), x.half(), edges, torch.randn(3, 5000) * 3]


@pytest.mark.gpu
@needs_cuda
def test_cuda_kernels_match_the_reference_bit_for_bit():
    """compress (FP32/FP16/BF16 input, ragged sizes, edge values), decompress to every dtype,
    gather and sum of several messages, for every format, G and switch."""
    dev = torch.device("cuda")
    failures = []
    _precompile(_gpu_configs(), 3)
    for cfg in _gpu_configs():
        for data in _inputs(cfg):
            ref = quant.compress(data, cfg)
            ker = cuda.compress(data.to(dev), cfg)
            if not torch.equal(quant.pack(ker).cpu(), quant.pack(ref)):
                failures.append(f"compress {cfg} {data.dtype} {tuple(data.shape)}")
                continue
            # an all-gather's own part: the decompression written by the compression pass itself
            own = torch.full(data.shape, float("nan"), dtype=data.dtype, device=dev)
            own_buf = cuda.compress_into(data.to(dev), cfg, torch.empty_like(quant.pack(ker)), own_out=own)
            if not torch.equal(own_buf.cpu(), quant.pack(ref)) or not same_bits(own.cpu(), quant.decompress(ref)):
                failures.append(f"compress with own_out {cfg} {data.dtype} {tuple(data.shape)}")
            for dtype in DTYPES:
                if not same_bits(cuda.decompress(ker, dtype).cpu(), quant.decompress(ref, dtype)):
                    failures.append(f"decompress {cfg} {data.dtype} -> {dtype}")
            # through quant's impl switch, from the reference's unpacked tensors too
            ref_dev = quant.Compressed(ref.payload.to(dev), ref.scale.to(dev),
                                       None if ref.pre_scale is None else ref.pre_scale.to(dev), ref.shape, ref.dtype, cfg)
            if not same_bits(quant.decompress(ref_dev, impl="cuda").cpu(), quant.decompress(ref)):
                failures.append(f"quant.decompress(impl='cuda') of an unpacked Compressed {cfg} {data.dtype}")
        # several messages: gather into place, sum in order (-0.0 kept by the first term)
        xs = [gaussian((5, 300), seed=s) for s in range(3)]
        refs = [quant.compress(x, cfg) for x in xs]
        bufs = [quant.pack(r).to(dev) for r in refs]
        msgs = [quant.packed_view(b, xs[0].shape, xs[0].dtype, cfg) for b in bufs]
        gathered = cuda.gather_into(msgs, torch.empty(3, *xs[0].shape, device=dev, dtype=torch.bfloat16)).cpu()
        for p in range(3):
            if not same_bits(gathered[p], quant.decompress(refs[p], torch.bfloat16)):
                failures.append(f"gather {cfg} message {p}")
        poisoned = torch.full((3, *xs[0].shape), float("nan"), device=dev, dtype=torch.bfloat16)
        skipped = cuda.gather_into(msgs, poisoned, skip=1).cpu()  # message 1 left as it was
        if not (skipped[1].isnan().all() and same_bits(skipped[0], gathered[0]) and same_bits(skipped[2], gathered[2])):
            failures.append(f"gather {cfg} skipping message 1")
        total = quant.decompress(refs[0], torch.float32)
        for r in refs[1:]:
            total = total + quant.decompress(r, torch.float32)
        for dtype in (torch.float32, torch.bfloat16):
            got = cuda.sum_into(msgs, torch.empty(xs[0].shape, device=dev, dtype=dtype)).cpu()
            if not same_bits(got, total.to(dtype)):
                failures.append(f"sum {cfg} -> {dtype}")
            # a reduce-scatter's own chunk: a raw tensor of the output's dtype in the middle, added exactly
            own = xs[1].to(dtype)
            expect = quant.decompress(refs[0], torch.float32) + own.float() + quant.decompress(refs[2], torch.float32)
            got = cuda.sum_into([msgs[0], own.to(dev), msgs[2]], torch.empty(xs[0].shape, device=dev, dtype=dtype)).cpu()
            if not same_bits(got, expect.to(dtype)):
                failures.append(f"sum with an own chunk {cfg} -> {dtype}")
            # two-shot's requantization: that sum in dtype, compressed, in one kernel
            requantized = torch.full(own.shape, float("nan"), dtype=dtype, device=dev)  # and its own part
            packed = cuda.sum_compress_into([msgs[0], own.to(dev), msgs[2]], dtype, cfg,
                                            torch.empty(cfg.wire_bytes(own.numel()), dtype=torch.uint8, device=dev),
                                            own_out=requantized)
            if not torch.equal(packed.cpu(), quant.pack(quant.compress(expect.to(dtype), cfg))):
                failures.append(f"sum_compress {cfg} in {dtype}")
            if not same_bits(requantized.cpu(), quant.decompress(quant.compress(expect.to(dtype), cfg))):
                failures.append(f"sum_compress's own part {cfg} in {dtype}")
        # segments: chunk q of x compressed into message q (also from strided rows, on a 3-block grid)
        x = torch.randn(4, 1000, device=dev, dtype=torch.bfloat16)
        seg, wire = cfg.packed_stride(1000), cfg.wire_bytes(1000)
        wide = torch.randn(4, 1512, device=dev, dtype=torch.bfloat16)
        wide[:, 256:1256] = x
        for what, src, blocks in (("contiguous", x, None), ("strided rows", wide[:, 256:1256], 3)):
            buf = cuda.compress_into(src, cfg, torch.full((4 * seg,), 7, dtype=torch.uint8, device=dev), segments=4,
                                     skip=2, max_blocks=blocks)
            for q in range(4):
                expect = quant.pack(quant.compress(x[q].cpu(), cfg)) if q != 2 else torch.full((wire,), 7, dtype=torch.uint8)
                if not torch.equal(buf[q * seg:q * seg + wire].cpu(), expect):
                    failures.append(f"segment {q} {cfg} (2 skipped, {what})")
    assert not failures, f"{len(failures)} mismatches: " + "; ".join(failures[:20])


@pytest.mark.gpu
@needs_cuda
def test_every_16bit_fetch_writes_the_reference_bytes():
    """One GPU. Compress of 16-bit input fetched by loads and by cp.async (whole items through the
    inbox, a ragged tail, strided segments with one skipped on a 3-block grid, an all-gather's own
    part) writes the reference's bytes, for the defaults and the configurations whose paths differ
    (no transform, G 32 and 512, single scale, adaptive)."""
    dev = torch.device("cuda")
    configs = [QuantConfig(128), QuantConfig(128, hadamard=False, dual_scale=False), QuantConfig(32),
               QuantConfig(512, "e5m2"), QuantConfig(128, dual_scale=False), QuantConfig(128, hadamard="adaptive")]
    failures = []
    for fetch in cuda.FETCH16_MODES:
        previous = cuda.set_tuning(cuda.Tuning(fetch16=fetch))
        try:
            for cfg, dtype in itertools.product(configs, (torch.bfloat16, torch.float16)):
                x = gaussian((9, 4226), seed=3).to(dtype)  # 37 whole items and a tail
                ref = quant.compress(x, cfg)
                own = torch.full(x.shape, float("nan"), dtype=dtype, device=dev)
                buf = cuda.compress_into(x.to(dev), cfg, torch.empty_like(quant.pack(ref), device=dev), own_out=own)
                if not torch.equal(buf.cpu(), quant.pack(ref)):
                    failures.append(f"{fetch} compress {cfg} {dtype}")
                if not same_bits(own.cpu(), quant.decompress(ref)):
                    failures.append(f"{fetch} own part {cfg} {dtype}")
                wide = gaussian((4, 3512), seed=4).to(dtype)
                seg, wire = cfg.packed_stride(3000), cfg.wire_bytes(3000)
                segs = cuda.compress_into(wide.to(dev)[:, 256:3256], cfg,
                                          torch.full((4 * seg,), 7, dtype=torch.uint8, device=dev), segments=4, skip=2,
                                          max_blocks=3).cpu()
                for q in range(4):
                    expect = (quant.pack(quant.compress(wide[q, 256:3256], cfg)) if q != 2
                              else torch.full((wire,), 7, dtype=torch.uint8))
                    if not torch.equal(segs[q * seg:q * seg + wire], expect):
                        failures.append(f"{fetch} segment {q} {cfg} {dtype}")
        finally:
            cuda.set_tuning(previous)
    assert not failures, f"{len(failures)} mismatches: " + "; ".join(failures[:20])


@pytest.mark.gpu
@needs_cuda
def test_cuda_kernels_timed_against_triton():
    """Median times (CUDA events) at 16 and 256 MiB of BF16, G=128: CUDA vs Triton (run with -s)."""
    from commweave.runtime.timers import cuda_median_us
    from commweave.taco import kernels

    dev = torch.device("cuda")
    print()
    for mib in (16, 256):
        xb = torch.randn(mib << 19, device=dev, dtype=torch.bfloat16)
        for cfg in (QuantConfig(128), QuantConfig(128, hadamard=False)):
            c = cuda.compress(xb, cfg)
            out = torch.empty_like(xb)
            t = {"compress_cuda": cuda_median_us(lambda: cuda.compress(xb, cfg), 20),
                 "compress_triton": cuda_median_us(lambda: kernels.compress(xb, cfg), 20),
                 "decompress_cuda": cuda_median_us(lambda: cuda.gather_into([c], out), 20),
                 "decompress_triton": cuda_median_us(lambda: kernels.decompress_into(c, out), 20)}
            traffic = xb.numel() * 2 + cfg.wire_bytes(xb.numel())
            print(f"taco-cuda {mib} MiB bf16 G=128 hadamard={cfg.hadamard!s:5} "
                  + " ".join(f"{k}={v:.1f}us" for k, v in t.items())
                  + f" | cuda compress {traffic / t['compress_cuda'] / 1e3:.0f} GB/s,"
                  + f" decompress {traffic / t['decompress_cuda'] / 1e3:.0f} GB/s")
            if cfg.hadamard and mib >= 256:  # TACO's scheme, bandwidth-bound: compress faster, decompress on par
                assert t["compress_cuda"] < t["compress_triton"] and t["decompress_cuda"] < 1.1 * t["decompress_triton"], t
