"""TACO quantizer on CPU: configuration, Hadamard transform, round-trip error bounds, edge inputs,
wire format."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from commweave.taco.quant import (FP8_MAX, QuantConfig, compress, decompress, fwht, pack, plain_fp8_cast,
                                  roundtrip, unpack)

GROUPS = [32, 64, 128, 256, 512]
MANTISSA_BITS = {"e4m3": 3, "e5m2": 2}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("bad", [16, 100, 1024, 0, -128, True, 128.0])
def test_group_size_must_be_a_power_of_two_in_range(bad):
    with pytest.raises(ValueError, match="group_size"):
        QuantConfig(group_size=bad)


def test_a_config_keeps_its_hash_through_pickling_and_replace():
    """The hash is computed once per config; a pickled or replaced config gets its own, equal to a
    fresh equal config's (the pickled one must not carry the other process's hash of a dtype)."""
    import dataclasses
    import pickle

    cfg = QuantConfig(64, "e5m2", hadamard="adaptive", transform_input_dtype=torch.bfloat16)
    same = QuantConfig(64, "e5m2", hadamard="adaptive", transform_input_dtype=torch.bfloat16)
    assert hash(cfg) == hash(same) and {cfg: 1}[same] == 1
    back = pickle.loads(pickle.dumps(cfg))
    assert back == cfg and hash(back) == hash(cfg) and "_hash" not in pickle.dumps(cfg).decode("latin-1")
    assert dataclasses.replace(cfg, fmt="e4m3") == QuantConfig(64, "e4m3", "adaptive", transform_input_dtype=torch.bfloat16)
    assert hash(dataclasses.replace(cfg, fmt="e4m3")) == hash(QuantConfig(64, "e4m3", "adaptive",
                                                                          transform_input_dtype=torch.bfloat16))


def test_bad_format_and_transform_dtype_are_rejected():
    for bad in (1, 1.0, "yes", None):
        with pytest.raises(ValueError, match="hadamard"):
            QuantConfig(hadamard=bad)
    with pytest.raises(ValueError, match="fmt"):
        QuantConfig(fmt="e3m4")
    with pytest.raises(ValueError, match="transform_input_dtype"):
        QuantConfig(transform_input_dtype=torch.float64)
    with pytest.raises(TypeError, match="floating-point"):
        compress(torch.arange(256), QuantConfig())


@pytest.mark.parametrize("n", GROUPS)
def test_hadamard_is_orthogonal_symmetric_and_its_own_inverse(n):
    h = fwht(torch.eye(n, dtype=torch.float64))
    eye = torch.eye(n, dtype=torch.float64)
    assert torch.allclose(h @ h.T, eye, atol=1e-12)
    assert torch.allclose(h, h.T, atol=1e-15)
    x = torch.randn(7, n, dtype=torch.float64)
    assert torch.allclose(fwht(fwht(x)), x, atol=1e-12)
    # Sylvester's matrix: H_2n = [[H, H], [H, -H]] / sqrt(2)
    sylvester = torch.ones(1, 1, dtype=torch.float64)
    while sylvester.shape[0] < n:
        sylvester = torch.cat([torch.cat([sylvester, sylvester], 1), torch.cat([sylvester, -sylvester], 1)], 0)
    assert torch.allclose(h, sylvester / math.sqrt(n), atol=1e-12)


def test_fwht_rejects_non_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        fwht(torch.zeros(3, 48))


@pytest.mark.parametrize("fmt,group_size", list(itertools.product(["e4m3", "e5m2"], GROUPS)))
def test_round_trip_error_bounds(fmt, group_size):
    """Rounding to m mantissa bits errs by at most 2^-(m+1) relative per element (normal range); the
    transform is orthogonal, so the tensor's relative error obeys the same bound in every mode.
    Gaussian data lands near the expected ~0.4 of it."""
    torch.manual_seed(group_size)
    x = torch.randn(64, 1024)
    bound = 2.0 ** -(MANTISSA_BITS[fmt] + 1)
    for hadamard, dual in itertools.product([False, True, "adaptive"], [False, True]):
        cfg = QuantConfig(group_size, fmt, hadamard=hadamard, dual_scale=dual)
        c = compress(x, cfg)
        assert c.payload.dtype == cfg.fp8_dtype and c.payload.shape == (x.numel() // group_size, group_size)
        assert (c.pre_scale is not None) == dual and c.scale.dtype == torch.float32
        err = rel(decompress(c), x)
        assert err < bound, (hadamard, dual, err)
        assert err < 0.45 * bound, (hadamard, dual, err)
    # the post-scale maps each group's absmax exactly to the FP8 maximum
    c = compress(x, QuantConfig(group_size, fmt))
    assert torch.allclose(c.payload.float().abs().amax(dim=1), torch.full((c.num_groups,), FP8_MAX[fmt]))


def test_bf16_input_keeps_its_dtype_and_shape():
    x = torch.randn(3, 5, 128).bfloat16()
    y = roundtrip(x, QuantConfig(128))
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert rel(y.float(), x.float()) < 0.035
    assert decompress(compress(x), torch.float32).dtype == torch.float32


def test_sizes_not_a_multiple_of_g_are_padded_or_rejected():
    x = torch.randn(3, 37)
    cfg = QuantConfig(32)
    c = compress(x, cfg)
    assert c.num_groups == 4 and decompress(c).shape == (3, 37)
    assert rel(decompress(c), x) < 0.035
    assert cfg.wire_bytes(111) == 4 * 32 + 4 * 4 * 2
    with pytest.raises(ValueError, match="pad=False"):
        compress(x, QuantConfig(32, pad=False))
    assert decompress(compress(torch.randn(64), QuantConfig(32, pad=False))).shape == (64,)


EDGE_CONFIGS = [QuantConfig(g, fmt, hadamard=h, dual_scale=d, transform_input_dtype=t)
                for g, fmt, h, d, t in itertools.product([32, 512], ["e4m3", "e5m2"], [False, True, "adaptive"], [False, True],
                                                         [torch.float32, torch.float16, torch.bfloat16])]


@pytest.mark.parametrize("cfg", EDGE_CONFIGS, ids=lambda c: f"G{c.group_size}-{c.fmt}-h{c.hadamard}"
                         f"-d{int(c.dual_scale)}-{str(c.transform_input_dtype)[6:]}")
def test_edge_inputs_give_no_nan_or_inf(cfg):
    n = 2048
    zeros = torch.zeros(n)
    y = roundtrip(zeros, cfg)
    assert torch.equal(y, zeros)
    const = torch.full((n,), -3.25)
    assert torch.allclose(roundtrip(const, cfg), const, rtol=0.07)
    sub = torch.full((n,), 3e-42) * torch.sign(torch.randn(n))  # FP32 subnormals
    sub[::7] = 0.0
    assert torch.isfinite(roundtrip(sub, cfg)).all()
    tiny = torch.randn(n) * 1e-30  # far below FP8 and FP16 range, normal in FP32
    out = roundtrip(tiny, cfg)
    assert torch.isfinite(out).all()
    if cfg.transform_input_dtype == torch.float32 or cfg.dual_scale or cfg.hadamard is not True:
        assert rel(out, tiny) < 0.13
    outliers = torch.randn(n)
    outliers[5], outliers[700], outliers[1500] = 1e30, -1e30, 1e6  # huge outliers inside groups
    assert torch.isfinite(roundtrip(outliers, cfg)).all()
    mixed = torch.randn(n)
    mixed[:512] = 0.0  # whole zero groups next to normal ones
    out = roundtrip(mixed, cfg)
    assert torch.isfinite(out).all() and torch.equal(out[:512], mixed[:512])


def test_dual_scales_handle_values_up_to_fp32_max():
    x = torch.randn(1024)
    x[3] = torch.finfo(torch.float32).max
    x[900] = -torch.finfo(torch.float32).max / 2
    for cfg in (QuantConfig(512), QuantConfig(32, "e5m2"), QuantConfig(128, hadamard=False)):
        assert torch.isfinite(roundtrip(x, cfg)).all()


def test_dual_scale_protects_a_16_bit_transform_from_underflow():
    """A Hadamard transform run on 16-bit inputs (as tensor-core kernels do) flushes near-zero groups
    into FP16 subnormals unless the RMS pre-scale has brought them to unit scale first."""
    x = torch.randn(64, 512) * 1e-7
    single = rel(roundtrip(x, QuantConfig(128, dual_scale=False, transform_input_dtype=torch.float16)), x)
    dual = rel(roundtrip(x, QuantConfig(128, dual_scale=True, transform_input_dtype=torch.float16)), x)
    fp32 = rel(roundtrip(x, QuantConfig(128, dual_scale=False)), x)
    assert dual < 0.035 and fp32 < 0.035 and single > 0.1  # measured 0.026, 0.026, 0.17


def test_plain_fp8_cast_baseline():
    x = torch.randn(4096) * 1e-6
    assert rel(plain_fp8_cast(x, "e4m3"), x) < 0.035
    assert rel(plain_fp8_cast(x, "e4m3", per_tensor_scale=False), x) > 0.5  # unscaled: underflow
    assert torch.equal(plain_fp8_cast(torch.zeros(8)), torch.zeros(8))


@pytest.mark.parametrize("dual", [False, True])
def test_pack_unpack_round_trip(dual):
    cfg = QuantConfig(64, "e5m2", dual_scale=dual)
    x = torch.randn(5, 100)
    c = compress(x, cfg)
    buf = pack(c)
    assert buf.dtype == torch.uint8 and buf.numel() == cfg.wire_bytes(x.numel()) == c.nbytes
    assert torch.equal(decompress(unpack(buf, x.shape, x.dtype, cfg)), decompress(c))
    with pytest.raises(ValueError, match="does not hold"):
        unpack(buf[:-4], x.shape, x.dtype, cfg)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_adaptive_hadamard_takes_the_better_of_both_per_group(fmt):
    """Per group the L2 error is the smaller of the two modes', so the tensor's is at most either's."""
    torch.manual_seed(1)
    x = torch.randn(256, 128)
    x[::4, 7] *= 300.0  # an outlier in every fourth group
    errs = {}
    for h in (False, True, "adaptive"):
        c = compress(x, QuantConfig(128, fmt, hadamard=h))
        errs[h] = (decompress(c) - x).square().sum(dim=1)
        if h == "adaptive":
            flags = c.scale < 0
            assert flags.any() and not flags.all()  # a per-group choice, both ways taken
            again = unpack(pack(c), x.shape, x.dtype, c.config)
            assert torch.equal(decompress(again), decompress(c))  # the flag survives the wire format
    assert (errs["adaptive"] <= torch.minimum(errs[False], errs[True]) * (1 + 1e-5) + 1e-12).all()


def test_the_taco_modules_import_one_another_without_a_circle():
    """Every import between commweave.taco's modules (module level or inside a function) forms a
    graph without circles: the reference does not reach the kernels, the collectives reach the
    device backend only one way."""
    import ast
    from pathlib import Path

    import commweave.taco

    root = Path(commweave.taco.__file__).parent
    modules = {p.stem for p in root.glob("*.py")} - {"__init__"}
    graph: dict[str, set[str]] = {}
    for name in modules:
        deps = set()
        for node in ast.walk(ast.parse((root / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "commweave.taco":
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("commweave.taco."):
                deps.add(node.module.split(".")[2])
            elif isinstance(node, ast.Import):
                deps |= {a.name.split(".")[2] for a in node.names if a.name.startswith("commweave.taco.")}
        graph[name] = (deps & modules) - {name}
    assert graph["quant"] == {"codec", "wire"} and "device" in graph["collectives"]  # the graph is read

    def circle_from(start: str, path: tuple[str, ...]) -> tuple[str, ...] | None:
        for nxt in graph[start]:
            if nxt in path:
                return path[path.index(nxt):] + (nxt,)
            found = circle_from(nxt, path + (nxt,))
            if found:
                return found
        return None

    circles = [c for m in sorted(modules) if (c := circle_from(m, (m,)))]
    assert circles == [], circles
