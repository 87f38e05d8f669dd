"""TACO's fused Triton kernels (commweave.taco.kernels) against the torch reference (quant.py).

CPU: Triton's interpreter runs only in a process that imported Triton with TRITON_INTERPRET=1, and
such a process cannot compile Triton kernels (other tests here do), so the interpreter checks run in
one spawned child process that has the variable (module fixture `interp`); their assertions run
there and come back as exceptions. Every check is bit for bit: payload bytes, scales, decompressed
values (signed zeros included) equal the reference's. The CPU path rounds in FP32 before its casts
(the interpreter's FP8/BF16 casts are wrong); that rounding is checked against torch's casts over
every value of each format and the midpoints between them. The parent process compiles the kernels
for sm_90 (no GPU needed) and checks the PTX for what bit-exactness relies on.

GPU (`pytest -m gpu tests/test_taco_kernels.py -s`): the compiled kernels (hardware casts and the
FP32 rounding path) against the reference, bit for bit, and timed at 16 and 256 MiB.
"""

from __future__ import annotations

import itertools
import math
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed (the kernels and their interpreter need it)")
import triton.language as tl  # noqa: E402

from commweave.runtime.timers import cuda_median_us  # noqa: E402
from taco_jobs import edge_inputs, gaussian, same_bits  # noqa: E402
from commweave.taco import kernels, quant  # noqa: E402
from commweave.taco.quant import QuantConfig  # noqa: E402

FORMATS = ["e4m3", "e5m2"]
GROUPS = [32, 128, 512]
HADAMARD = [False, True, "adaptive"]
MANTISSA_BITS = {"e4m3": 3, "e5m2": 2}


# -- the interpreter child ------------------------------------------------------------------------

def _child_mode() -> tuple[bool, str]:
    return bool(triton.knobs.runtime.interpret), triton.__version__


@pytest.fixture(scope="module")
def interp():
    """One spawned process whose Triton runs the interpreter; jobs are this module's functions."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"  # inherited by the child at spawn, then restored here
    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    try:
        interpreting, _ = pool.submit(_child_mode).result(timeout=300)
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old
    assert interpreting, "the child's Triton did not start in interpreter mode"
    yield lambda fn, *args, **kw: pool.submit(fn, *args, **kw).result(timeout=300)
    pool.shutdown()


def _check_against_reference(x: torch.Tensor, cfg: QuantConfig, out_dtypes: tuple[torch.dtype, ...] = ()) -> float:
    """Kernel vs reference on x, both directions; returns the round trip's relative error."""
    ref = quant.compress(x, cfg)
    ker = kernels.compress(x, cfg)
    assert ker.payload.dtype == ref.payload.dtype and ker.payload.shape == ref.payload.shape
    assert same_bits(ker.scale, ref.scale), (cfg, (ker.scale != ref.scale).sum())
    if cfg.dual_scale:
        assert same_bits(ker.pre_scale, ref.pre_scale), (cfg, (ker.pre_scale != ref.pre_scale).sum())
    else:
        assert ker.pre_scale is None
    bad = (ker.payload.view(torch.uint8) != ref.payload.view(torch.uint8)).sum().item()
    assert bad == 0, f"{bad} payload bytes differ under {cfg}"
    assert torch.equal(quant.pack(ker), quant.pack(ref))
    expect = quant.decompress(ref)
    assert same_bits(kernels.decompress(ref), expect), cfg
    assert same_bits(kernels.decompress(ker), expect), cfg
    for dtype in out_dtypes:
        assert same_bits(kernels.decompress(ref, dtype), quant.decompress(ref, dtype)), (cfg, dtype)
    xf, yf = x.double(), expect.double()
    return float((yf - xf).norm() / xf.norm()) if xf.norm() > 0 else 0.0


def _job_bit_exact(fmt: str, group_size: int, hadamard: bool | str, dual: bool) -> None:
    x = gaussian((37, 129), seed=group_size)  # 4773 elements: not a multiple of any G (padding)
    cfg = QuantConfig(group_size, fmt, hadamard=hadamard, dual_scale=dual)
    _check_against_reference(x, cfg)
    # error bound on plain Gaussian data (one rounding to m mantissa bits, as test_taco_quant.py)
    y = torch.randn(16, 1024, generator=torch.Generator().manual_seed(7))
    err = _check_against_reference(y, cfg)
    assert err < 0.45 * 2.0 ** -(MANTISSA_BITS[fmt] + 1), (cfg, err)


@pytest.mark.parametrize("fmt,group_size,hadamard,dual", list(itertools.product(FORMATS, GROUPS, HADAMARD, [False, True])))
def test_kernels_match_the_reference_bit_for_bit(interp, fmt, group_size, hadamard, dual):
    interp(_job_bit_exact, fmt, group_size, hadamard, dual)


def _job_transform_input_dtype(cast: torch.dtype, hadamard: bool | str, dual: bool) -> None:
    """16-bit transform inputs: near-zero groups (FP16 subnormals), huge ones (clamped), normal."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(24, 256, generator=gen)
    x[:8] *= 1e-7
    x[8:12] *= 1e6
    x[12, 5] = 3e38
    for g in (32, 128):
        _check_against_reference(x, QuantConfig(g, "e4m3", hadamard=hadamard, dual_scale=dual, transform_input_dtype=cast))


@pytest.mark.parametrize("cast,hadamard,dual", list(itertools.product([torch.float16, torch.bfloat16], [True, "adaptive"],
                                                                       [False, True])))
def test_16_bit_transform_inputs_match_bit_for_bit(interp, cast, hadamard, dual):
    interp(_job_transform_input_dtype, cast, hadamard, dual)


def _job_edges(group_size: int, fmt: str) -> None:
    x = edge_inputs()
    for hadamard, dual, cast in itertools.product(HADAMARD, [False, True], [torch.float32, torch.float16, torch.bfloat16]):
        cfg = QuantConfig(group_size, fmt, hadamard=hadamard, dual_scale=dual, transform_input_dtype=cast)
        # single scale + transform: finite only for |x| <= FP32_MAX / G (quant.py), the reference too
        piece = x[: 5 * 2048] if hadamard and not dual else x
        _check_against_reference(piece, cfg)
        out = kernels.decompress(kernels.compress(piece, cfg))
        assert torch.isfinite(out).all(), cfg
        assert torch.equal(out[:2048], torch.zeros(2048)), cfg


@pytest.mark.parametrize("group_size,fmt", list(itertools.product([32, 512], FORMATS)))
def test_edge_inputs_match_bit_for_bit_without_nan(interp, group_size, fmt):
    interp(_job_edges, group_size, fmt)


def _job_dtypes() -> None:
    """BF16/FP16 inputs (BF16 subnormals included) and FP32/FP16/BF16 outputs."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(5, 300, generator=gen)
    x[0] *= 1e-39  # BF16 subnormals
    x[1] *= 1e3
    for dtype in (torch.bfloat16, torch.float16):
        for cfg in (QuantConfig(128), QuantConfig(32, "e5m2", hadamard="adaptive"),
                    QuantConfig(64, hadamard=False, dual_scale=False)):
            xi = x.to(dtype)
            _check_against_reference(xi, cfg, out_dtypes=(torch.float32, torch.float16, torch.bfloat16))
            assert kernels.decompress(kernels.compress(xi, cfg)).dtype == dtype
    big = torch.randn(4, 128, generator=gen) * 1e6  # FP16 output overflows to inf, as torch's cast does
    c = quant.compress(big, QuantConfig(128))
    assert same_bits(kernels.decompress(c, torch.float16), quant.decompress(c, torch.float16))


def test_half_precision_inputs_and_outputs_match_bit_for_bit(interp):
    interp(_job_dtypes)


def _job_layout() -> None:
    """The packed layout both ways, and compress_into a window at an offset inside a larger buffer."""
    x = gaussian((3, 1000), seed=2)
    for cfg in (QuantConfig(128), QuantConfig(64, "e5m2", dual_scale=False), QuantConfig(32, hadamard="adaptive")):
        ref_buf = quant.pack(quant.compress(x, cfg))
        ker = kernels.compress(x, cfg)
        assert torch.equal(quant.pack(ker), ref_buf)
        # kernel output read by the reference; reference output read by the kernel
        from_kernel = quant.unpack(quant.pack(ker), x.shape, x.dtype, cfg)
        from_ref = quant.unpack(ref_buf, x.shape, x.dtype, cfg)
        expect = quant.decompress(from_ref)
        assert same_bits(quant.decompress(from_kernel), expect)
        assert same_bits(kernels.decompress(from_ref), expect)
        window = torch.full((256 + ref_buf.numel() + 64,), 0xAB, dtype=torch.uint8)
        kernels.compress_into(x, cfg, window[256:256 + ref_buf.numel()])
        assert torch.equal(window[256:256 + ref_buf.numel()], ref_buf)
        assert (window[:256] == 0xAB).all() and (window[-64:] == 0xAB).all()
        # through quant's switch
        assert torch.equal(quant.pack(quant.compress(x, cfg, impl="triton")), ref_buf)
        assert same_bits(quant.decompress(from_ref, impl="triton"), expect)


def test_pack_layout_is_shared_both_ways(interp):
    interp(_job_layout)


def _job_accumulate() -> None:
    """The FP32 sum of several compressed parts, as collectives._sum_fp32 computes it."""
    from commweave.taco.collectives import _sum_fp32

    gen = torch.Generator().manual_seed(9)
    for cfg in (QuantConfig(128), QuantConfig(32, "e5m2", hadamard="adaptive", dual_scale=False)):
        parts = [quant.compress(torch.randn(6, 77, generator=gen) * (r + 1), cfg) for r in range(4)]
        acc = kernels.decompress(parts[0], torch.float32)
        for p in parts[1:]:
            assert kernels.decompress_accumulate(p, acc) is acc
        assert same_bits(acc, _sum_fp32(parts, torch.float32))


def test_decompress_accumulate_matches_the_reference_sum(interp):
    interp(_job_accumulate)


def _job_rejections() -> None:
    cfg = QuantConfig(32)
    for bad, err, match in [(torch.randn(64, dtype=torch.float64), TypeError, "float64"),
                            (torch.arange(64), TypeError, "floating-point")]:
        with pytest.raises(err, match=match):
            kernels.compress(bad, cfg)
    with pytest.raises(ValueError, match="pad=False"):
        kernels.compress(torch.randn(40), QuantConfig(32, pad=False))
    with pytest.raises(ValueError, match="uint8"):
        kernels.compress_into(torch.randn(64), cfg, torch.empty(10, dtype=torch.uint8))
    c = quant.compress(torch.randn(64), cfg)
    with pytest.raises(TypeError, match="output"):
        kernels.decompress(c, torch.float64)
    with pytest.raises(ValueError, match="acc"):
        kernels.decompress_accumulate(c, torch.zeros(64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="dual_scale"):
        kernels.decompress(quant.Compressed(c.payload, c.scale, None, c.shape, c.dtype, cfg))
    empty = kernels.compress(torch.empty(0), cfg)
    assert empty.num_groups == 0 and kernels.decompress(empty).shape == (0,)


def test_bad_arguments_are_rejected_with_the_reason(interp):
    interp(_job_rejections)


@triton.jit
def _round_kernel(x_ptr, out_ptr, n, MANT: tl.constexpr, EMIN: tl.constexpr, MAGIC: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, kernels._round_to_format(tl.load(x_ptr + offs, mask=mask), MANT, EMIN, MAGIC), mask=mask)


def _job_round_to_format(dtype: torch.dtype) -> None:
    """kernels._round_to_format against torch's cast: every finite value of the format, the
    midpoints between neighbours (ties to even), one FP32 ulp either side, FP32 subnormals."""
    if dtype.itemsize == 1:
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    else:
        codes = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16)
    values = codes.view(dtype).float()
    values = values[torch.isfinite(values)].double().unique()  # sorted, -max..max
    mids = ((values[1:] + values[:-1]) / 2).float()
    grid = values.float()
    candidates = [grid, mids, torch.nextafter(mids, torch.full_like(mids, math.inf)),
                  torch.nextafter(mids, torch.full_like(mids, -math.inf)), torch.tensor([-0.0, 0.0, 1e-45, -1e-45, 3e-39])]
    if dtype == torch.bfloat16:  # past BF16's maximum: rounds to inf like the cast
        top = torch.finfo(torch.float32).max
        candidates.append(torch.tensor([top, -top, 3.3961e38, 3.3963e38]))
    x = torch.cat(candidates).contiguous()
    out = torch.empty_like(x)
    mant, emin = kernels._FORMATS[dtype]
    _round_kernel[(triton.cdiv(x.numel(), 1 << 16),)](x, out, x.numel(), MANT=mant, EMIN=emin,
                                                      MAGIC=math.ldexp(1.5, 23 + emin - mant), BLOCK=1 << 16)
    expect = x.to(dtype).float()
    bad = ~(out.view(torch.int32) == expect.view(torch.int32))
    assert not bad.any(), (f"{int(bad.sum())} of {x.numel()} differ, e.g. {x[bad][:4].tolist()} -> "
                           f"{out[bad][:4].tolist()} vs {expect[bad][:4].tolist()}")


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.float16, torch.bfloat16])
def test_fp32_rounding_matches_torch_casts_on_every_value_and_tie(interp, dtype):
    interp(_job_round_to_format, dtype)


# -- in this process: no interpreter -----------------------------------------------------------------

def test_cpu_tensors_need_the_interpreter():
    if triton.knobs.runtime.interpret:
        pytest.skip("this process itself runs Triton's interpreter")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        kernels.compress(torch.randn(128), QuantConfig())
    with pytest.raises(ValueError, match="impl"):
        quant.compress(torch.randn(128), QuantConfig(), impl="cuda")  # type: ignore[arg-type]


def test_reference_sqrt_is_correctly_rounded():
    """quant._sqrt_rn against numpy's FP32 sqrt (IEEE, correctly rounded), which the kernels' sqrt_rn
    equals; torch's own CPU sqrt differs in the last bit on many inputs."""
    np = pytest.importorskip("numpy")
    gen = torch.Generator().manual_seed(0)
    m = torch.cat([torch.rand(1 << 20, generator=gen) * 4, torch.rand(1 << 16, generator=gen) * 1e-30,
                   torch.tensor([0.0, 1.0, 4.0, 1e-45, torch.finfo(torch.float32).max])])
    assert torch.equal(quant._sqrt_rn(m), torch.from_numpy(np.sqrt(m.numpy())))


def test_kernels_compile_for_sm90_with_exact_arithmetic():
    """What bit-exactness on the GPU relies on, visible in the PTX: IEEE division and square root,
    no FMA contraction, no flush-to-zero, hardware round-to-nearest FP8 casts, no register spills."""
    if triton.knobs.runtime.interpret:
        pytest.skip("this process runs Triton's interpreter, which cannot compile")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    cfg = QuantConfig(128, "e4m3")
    common = dict(G=128, LOG_G=7, FWHT_SCALE=1 / math.sqrt(128), ROWS=16, DUAL=True, HADAMARD=1, ROUND=False)
    compress_consts = dict(common, FP8_MAX=cfg.fp8_max, TINY=kernels._TINY, CAST=0, CAST_MAX=0.0,
                           **kernels._format_args(torch.float8_e4m3fn, "Q"), **kernels._format_args(torch.float32, "C"),
                           IN_BF16=True)
    decompress_consts = dict(common, ACCUMULATE=False, **kernels._format_args(torch.bfloat16, "O"))
    ptrs = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "pre_ptr": "*fp32", "out_ptr": "*bf16"}
    e5m2_consts = dict(compress_consts, HADAMARD=0, FP8_MAX=QuantConfig(fmt="e5m2").fp8_max,
                       **kernels._format_args(torch.float8_e5m2, "Q"))
    for fn, consts, args in [(kernels._compress_kernel, compress_consts, ["x_ptr", "q_ptr", "scale_ptr", "pre_ptr"]),
                             (kernels._compress_kernel, e5m2_consts, ["x_ptr", "q_ptr", "scale_ptr", "pre_ptr"]),
                             (kernels._decompress_kernel, decompress_consts, ["q_ptr", "scale_ptr", "pre_ptr", "out_ptr"])]:
        fp8 = "fp8e5" if consts.get("Q_MANT") == 2 else "fp8e4nv"
        signature = {**{a: ptrs[a] for a in args}, "numel": "i64", "n_groups": "i64", **{k: "constexpr" for k in consts}}
        signature["q_ptr"] = "*" + fp8
        compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts),
                                  target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False})
        ptx = compiled.asm["ptx"]
        assert ".target sm_90" in ptx and "fma.rn.f32" not in ptx and ".ftz" not in ptx
        assert "div.approx" not in ptx and "div.full" not in ptx and "sqrt.approx" not in ptx
        assert "ld.local" not in ptx and "st.local" not in ptx
        if fn is kernels._compress_kernel:
            assert "div.rn.f32" in ptx and "sqrt.rn.f32" in ptx
            assert f"cvt.rn.satfinite.{'e5m2' if fp8 == 'fp8e5' else 'e4m3'}x2.f32" in ptx
        else:
            assert "cvt.rn.bf16" in ptx


# -- GPU ------------------------------------------------------------------------------------------

def _gpu_configs() -> list[tuple[QuantConfig, bool]]:
    """(config, round_in_fp32) pairs for the CUDA check: every format, G and switch with hardware
    casts, adaptive and 16-bit transform inputs at G=128 (each adaptive variant compiles for ~30 s),
    and the FP32-rounding path on a few. ~40 kernel specializations to compile."""
    pairs = [(QuantConfig(g, fmt, hadamard=h, dual_scale=d), False)
             for fmt, g, h, d in itertools.product(FORMATS, GROUPS, [False, True], [False, True])]
    pairs += [(QuantConfig(128, fmt, hadamard="adaptive", dual_scale=d), False)
              for fmt, d in itertools.product(FORMATS, [False, True])]
    pairs += [(QuantConfig(128, hadamard=h, dual_scale=d, transform_input_dtype=t), False)
              for h, d, t in [(True, True, torch.float16), (True, False, torch.float16), (True, True, torch.bfloat16),
                              (True, False, torch.bfloat16), ("adaptive", True, torch.bfloat16)]]
    pairs += [(QuantConfig(128), True), (QuantConfig(32, "e5m2", hadamard="adaptive"), True),
              (QuantConfig(512, hadamard=False, dual_scale=False), True),
              (QuantConfig(128, dual_scale=False, transform_input_dtype=torch.bfloat16), True)]
    return pairs


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
def test_compiled_kernels_on_cuda_match_the_reference_bit_for_bit():
    """The compiled kernels (hardware casts; the FP32-rounding path on some) against the reference
    computed on CPU, bit for bit: payload, scales, FP32 and BF16 decompression, accumulation."""
    dev = torch.device("cuda")
    x = gaussian((37, 129), seed=1)
    edges = edge_inputs()
    for cfg, round_in_fp32 in _gpu_configs():
        for data in (x, x.bfloat16(), edges[: 5 * 2048] if cfg.hadamard and not cfg.dual_scale else edges):
            ref = quant.compress(data, cfg)
            ker = kernels.compress(data.to(dev), cfg, round_in_fp32=round_in_fp32)
            assert torch.equal(quant.pack(ker).cpu(), quant.pack(ref)), (cfg, round_in_fp32, data.dtype)
            for dtype in (torch.float32, torch.bfloat16):
                out = kernels.decompress(ker, dtype, round_in_fp32=round_in_fp32).cpu()
                assert same_bits(out, quant.decompress(ref, dtype)), (cfg, dtype, round_in_fp32)
        acc = kernels.decompress(ker, torch.float32)
        kernels.decompress_accumulate(ker, acc)
        expect = quant.decompress(ref, torch.float32)
        assert torch.equal(acc.cpu(), expect + expect), cfg


@pytest.mark.gpu
@needs_cuda
def test_compiled_kernels_timed_against_the_reference():
    """Median times (CUDA events) at 16 and 256 MiB of BF16 input, G=128; printed (run with -s)."""
    dev = torch.device("cuda")
    print()
    for mib in (16, 256):
        xb = torch.randn(mib << 19, device=dev, dtype=torch.bfloat16)  # mib MiB of BF16
        for cfg in (QuantConfig(128), QuantConfig(128, hadamard=False), QuantConfig(128, hadamard="adaptive")):
            c = kernels.compress(xb, cfg)
            acc = torch.zeros(xb.numel(), device=dev)
            t = {"compress": cuda_median_us(lambda: kernels.compress(xb, cfg), 20) / 1e3,
                 "compress_ref": cuda_median_us(lambda: quant.compress(xb, cfg), 5, warmup=1) / 1e3,
                 "compress_round_fp32": cuda_median_us(lambda: kernels.compress(xb, cfg, round_in_fp32=True), 20) / 1e3,
                 "decompress": cuda_median_us(lambda: kernels.decompress(c), 20) / 1e3,
                 "decompress_ref": cuda_median_us(lambda: quant.decompress(c), 5, warmup=1) / 1e3,
                 "decompress_accumulate": cuda_median_us(lambda: kernels.decompress_accumulate(c, acc), 20) / 1e3}
            traffic = xb.numel() * 2 + cfg.wire_bytes(xb.numel())  # BF16 in (out) + wire bytes out (in), once each
            print(f"taco-kernels {mib} MiB bf16 G=128 hadamard={cfg.hadamard!s:8} "
                  + " ".join(f"{k}={v:.3f}ms" for k, v in t.items())
                  + f" | compress {traffic / t['compress'] / 1e6:.0f} GB/s,"
                  + f" decompress {traffic / t['decompress'] / 1e6:.0f} GB/s")
            assert t["compress"] < t["compress_ref"] and t["decompress"] < t["decompress_ref"], t
