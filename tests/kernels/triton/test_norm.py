"""Triton LayerNorm, RMSNorm, LayerNormalization, Softmax and LogSoftmax against the reference.

Short rows share a program, long rows loop over blocks: the tests shrink the block limits so that
the loops run on small shapes (the interpreter is slow). Inputs are fresh random values; float32
must agree within 1e-5 of the output's scale, float16/bfloat16 within 1e-2.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from tensorkiln.kernels.cuda.convert import to_numpy, to_torch  # noqa: E402
from tensorkiln.kernels.registry import invoke, lookup  # noqa: E402
from tensorkiln.kernels.tactics import LayerSpec, get_tactic  # noqa: E402
from tensorkiln.kernels.triton import norm, softmax  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.float32, np.float16, BF16]
DTYPE_IDS = ["float32", "float16", "bfloat16"]
OPSET = {"": 17, "tensorkiln": 1}
rng = np.random.default_rng()


@pytest.fixture(params=["one block", "looped"])
def rows_path(request, monkeypatch):
    """Run each test once with rows in one block and once with rows looped over small blocks."""
    if request.param == "looped":
        for module in (norm, softmax):
            monkeypatch.setattr(module, "MAX_BLOCK", 32)
            monkeypatch.setattr(module, "LOOP_BLOCK", 16)
    return request.param


def randn(*shape: int, dtype=np.float32, scale: float = 1.0, shift: float = 0.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale + shift).astype(dtype)


def spec_of(op: str, domain: str, args: list, attrs: dict) -> LayerSpec:
    shapes = tuple(None if a is None else a.shape for a in args)
    dtypes = tuple(None if a is None else a.dtype.name for a in args)
    return LayerSpec(op, domain, attrs, shapes, dtypes, DEVICE)


def check(
    op: str, domain: str, args: list, attrs: dict | None = None, n_outputs: int = 1,
    name: str = "triton",
):  # fmt: skip
    """The op's Triton tactic ``name`` against its reference kernel on ``args``, output by
    output."""
    attrs = attrs or {}
    tactic = get_tactic(op, domain, name)
    assert tactic.applies(spec_of(op, domain, args, attrs))
    ref = invoke(lookup(op, domain, OPSET.get(domain, 17)), args, attrs, n_outputs)
    tensors = [None if a is None else to_torch(a, DEVICE) for a in args]
    while tensors and tensors[-1] is None:
        tensors.pop()
    got = tactic.fn(*tensors, **attrs, **({"_n_outputs": n_outputs} if n_outputs > 1 else {}))
    got = list(got) if isinstance(got, tuple) else [got]
    assert len(got) == n_outputs
    for k, (g, r) in enumerate(zip(got, ref)):
        g = to_numpy(g)
        assert g.shape == r.shape and g.dtype == r.dtype, (
            f"output {k}: {g.dtype}{g.shape} {r.dtype}{r.shape}"
        )
        tol = 1e-5 if r.dtype == np.float32 else 1e-2
        finite = np.abs(r.astype(np.float32))[np.isfinite(r.astype(np.float32))]
        scale = float(finite.max()) if finite.size else 0.0  # (LogSoftmax of -inf is -inf)
        np.testing.assert_allclose(
            g.astype(np.float32),
            r.astype(np.float32),
            rtol=tol,
            atol=tol * scale,
            err_msg=f"output {k}",
        )


# ------------------------------------------------------------------------- LayerNorm / RMSNorm


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_layer_norm(rows_path, dtype):
    x = randn(3, 5, 40, dtype=dtype, scale=3, shift=2)  # a mean far from 0: centring matters
    w, b = randn(40, dtype=dtype), randn(40, dtype=dtype)
    check("LayerNorm", "tensorkiln", [x, w, b], {"epsilon": 1e-3})
    check("LayerNorm", "tensorkiln", [x, w], {})


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_layer_norm_with_residual_and_its_sum(rows_path, dtype):
    x, res = randn(4, 7, 24, dtype=dtype), randn(4, 7, 24, dtype=dtype)
    w, b = randn(24, dtype=dtype), randn(24, dtype=dtype)
    check("LayerNorm", "tensorkiln", [x, w, b, res], n_outputs=2)
    check("LayerNorm", "tensorkiln", [x, w, None, res])
    check("LayerNorm", "tensorkiln", [x, w, b], n_outputs=2)  # no residual: the sum is x


def test_layer_norm_with_a_broadcast_residual(rows_path):
    """The fused Add broadcasts: a position embedding [1, S, H] added to a batch of token
    embeddings (the engine is built at batch 1 and run at batch 4), and the other way round."""
    big, small = randn(4, 7, 24), randn(1, 7, 24)
    w, b = randn(24), randn(24)
    check("LayerNorm", "tensorkiln", [big, w, b, small], n_outputs=2)
    check("LayerNorm", "tensorkiln", [small, w, b, big], n_outputs=2)
    # read in place as repeating rows: [S, H], one row; copied: a broadcast that is not a
    # repetition of whole rows ([B, 1, H] over [B, S, H]), both operands broadcast
    for other in (randn(7, 24), randn(1, 1, 24), randn(4, 1, 24)):
        check("LayerNorm", "tensorkiln", [big, w, b, other], n_outputs=2)
    check("LayerNorm", "tensorkiln", [randn(4, 1, 24), w, b, small], n_outputs=2)


def test_row_period():
    """Which broadcast residuals the kernel reads in place, as rows that repeat."""
    assert norm._row_period((1, 7, 24), (4, 7, 24)) == 7
    assert norm._row_period((7, 24), (4, 7, 24)) == 7
    assert norm._row_period((1, 1, 24), (4, 7, 24)) == 1
    assert norm._row_period((24,), (4, 7, 24)) == 1
    assert norm._row_period((2, 7, 24), (3, 2, 7, 24)) == 14
    for small in ((4, 1, 24), (1, 7, 1), (3, 1, 7, 24)):
        assert norm._row_period(small, (4, 7, 24) if len(small) == 3 else (3, 2, 7, 24)) == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rms_norm(rows_path, dtype):
    check("RMSNorm", "tensorkiln", [randn(6, 50, dtype=dtype), randn(50, dtype=dtype)])
    check("RMSNorm", "tensorkiln", [randn(2, 3, 33), randn(1, 33)], {"epsilon": 1e-2})


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_layer_normalization_with_statistics(rows_path, dtype):
    x, w, b = randn(2, 9, 36, dtype=dtype, shift=1), randn(36, dtype=dtype), randn(36, dtype=dtype)
    check("LayerNormalization", "", [x, w, b], {"axis": -1, "epsilon": 1e-5}, n_outputs=3)
    check("LayerNormalization", "", [x, w], {"axis": 2})


def test_rows_of_one_and_empty_inputs():
    check("LayerNorm", "tensorkiln", [randn(5, 1), randn(1), randn(1)])
    check("RMSNorm", "tensorkiln", [randn(0, 8), randn(8)])
    check("Softmax", "", [randn(4, 1)])
    check("Softmax", "", [randn(0, 3, 5)], {"axis": -1})


def test_norm_supports():
    fits = get_tactic("LayerNorm", "tensorkiln", "triton").applies
    x, w = randn(2, 3, 8), randn(8)
    assert fits(spec_of("LayerNorm", "tensorkiln", [x, w], {}))
    assert not fits(spec_of("LayerNorm", "tensorkiln", [x, w], {"axis": 1}))  # two axes
    assert not fits(spec_of("LayerNorm", "tensorkiln", [x, randn(3, 8)], {}))  # scale per row
    assert not fits(spec_of("LayerNorm", "tensorkiln", [x.astype(np.float64), w], {}))
    assert fits(spec_of("LayerNorm", "tensorkiln", [x, w, None, randn(3, 8)], {}))  # broadcast
    assert not fits(spec_of("LayerNorm", "tensorkiln", [x, w, None, randn(4, 8)], {}))
    assert not fits(spec_of("LayerNorm", "tensorkiln", [x, w, None, randn(3, 1)], {}))
    onnx_fits = get_tactic("LayerNormalization", "", "triton").applies
    assert not onnx_fits(spec_of("LayerNormalization", "", [x, w], {"stash_type": 11}))
    assert onnx_fits(spec_of("LayerNormalization", "", [x, w], {"axis": 2}))


# ------------------------------------------------------------------------- Softmax


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
def test_softmax(rows_path, op, dtype):
    check(op, "", [randn(3, 4, 45, dtype=dtype, scale=4)], {"axis": -1})
    check(op, "", [randn(7, 20, dtype=dtype, scale=4)])


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
def test_softmax_masked_rows(rows_path, op):
    """-inf where an attention mask removes a key, with whole masked blocks of a long row."""
    x = randn(4, 40, scale=3)
    x[:, :20] = -np.inf
    x[1, 25:] = -np.inf
    x[2, ::3] = -np.inf
    check(op, "", [x], {"axis": 1})


def test_softmax_supports():
    fits = get_tactic("Softmax", "", "triton").applies
    assert fits(spec_of("Softmax", "", [randn(2, 3, 5)], {"axis": -1}))
    assert fits(spec_of("Softmax", "", [randn(2, 3, 5)], {"axis": 2}))
    assert not fits(spec_of("Softmax", "", [randn(2, 3, 5)], {"axis": 1}))
    # no axis: -1 from opset 13, 1 (a flattening) below it; only rank 2 means the same in both
    assert not fits(spec_of("Softmax", "", [randn(2, 3, 5)], {}))
    assert fits(spec_of("Softmax", "", [randn(3, 5)], {}))


# ------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("n", [768, 4096, 50000])
def test_large_rows_on_the_gpu(dtype, n):
    rows = max(1, (1 << 22) // n)
    x, res = randn(rows, n, dtype=dtype, shift=1), randn(rows, n, dtype=dtype)
    w, b = randn(n, dtype=dtype), randn(n, dtype=dtype)
    check("LayerNorm", "tensorkiln", [x, w, b, res], n_outputs=2)
    check("RMSNorm", "tensorkiln", [x, w])
    check("LayerNormalization", "", [x, w, b], n_outputs=3)
    check("Softmax", "", [x], {"axis": -1})
    check("LogSoftmax", "", [x], {"axis": -1})


@pytest.mark.parametrize("q_dtype", [3, 17], ids=["int8", "float8"])
@pytest.mark.parametrize("with_sum", [False, True], ids=["y-q", "y-q-sum"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["float32", "float16"])
def test_layer_norm_writes_its_output_quantized(rows_path, q_dtype, with_sum, dtype):
    """LayerNorm with Y_scale and q_dtype: the second output is the first quantized, bit for bit
    QuantizeLinear's reference kernel on the values the tactic wrote (int8 and float8 E4M3,
    saturating: the scale puts some values past the type's range); the first output and the
    sum (third) as the reference's. Rows that fit a block quantize in the kernel, looped rows
    through QuantizeLinear."""
    from tensorkiln.kernels.reference.quant import quantize_linear

    x, r = randn(3, 5, 48, dtype=dtype), randn(3, 5, 48, dtype=dtype)
    if with_sum:  # (and a residual that broadcasts x: the outputs take the broadcast shape)
        x = x[:1]
    w, b = randn(48, dtype=dtype, shift=1.0), randn(48, dtype=dtype)
    top = 127 if q_dtype == 3 else 448
    y_scale = np.float32(rng.uniform(2.0, 4.0) / top)  # (|y| beyond 2 saturates)
    args = [x, w, b, r, y_scale]
    attrs = {"epsilon": 1e-5, "q_dtype": q_dtype}
    n = 3 if with_sum else 2
    tactic = get_tactic("LayerNorm", "tensorkiln", "triton")
    assert tactic.applies(spec_of("LayerNorm", "tensorkiln", args, attrs))
    ref = invoke(lookup("LayerNorm", "tensorkiln", 1), args, attrs, n)
    got = tactic.fn(*(to_torch(a, DEVICE) for a in args), **attrs, _n_outputs=n)
    assert len(got) == n
    y = to_numpy(got[0])
    tol = 1e-5 if dtype == np.float32 else 1e-2
    np.testing.assert_allclose(y.astype(np.float32), ref[0].astype(np.float32), rtol=tol,
                               atol=tol * np.abs(ref[0]).max())  # fmt: skip
    q, want = to_numpy(got[1]), quantize_linear(y, y_scale, output_dtype=q_dtype)
    assert q.dtype == want.dtype == ref[1].dtype
    np.testing.assert_array_equal(q.view(np.uint8), want.view(np.uint8))
    assert (np.abs(want.astype(np.float32)) >= top).any()  # (saturation was exercised)
    if with_sum:
        np.testing.assert_allclose(to_numpy(got[2]).astype(np.float32),
                                   ref[2].astype(np.float32), rtol=tol, atol=tol)  # fmt: skip


@pytest.mark.parametrize("q_dtype", [1, 7, 999])
def test_a_quantized_output_of_another_type_is_refused(q_dtype):
    """An engine file may name any q_dtype: anything but int8 and float8 E4M3 is refused by
    name, by the tactic and by the default kernel, never written as uninitialized memory."""
    x, w = randn(2, 16), randn(16)
    args = [to_torch(a, DEVICE) for a in (x, w)] + [None, None, to_torch(np.float32(0.1), DEVICE)]
    for fn in (get_tactic("LayerNorm", "tensorkiln", "triton").fn,
               lookup("LayerNorm", "tensorkiln", 1, "cuda").fn):  # fmt: skip
        with pytest.raises(ValueError, match="q_dtype"):
            fn(*args, q_dtype=q_dtype, _n_outputs=2)


@pytest.mark.parametrize("q_dtype", [3, 17], ids=["int8", "float8"])
def test_the_quantizing_layer_norm_at_other_tiles(q_dtype):
    """The quantizing LayerNorm's tile variants (the autotuner times them beside the default
    tile) write what the default tactic writes, for quantizing LayerNorms only, and only where
    their rows fit the block they hold. (Compiled, another tile sums a row in another order:
    float16 outputs one rounding apart, and so codes a step apart where a value lies at a
    rounding boundary; through the interpreter, the same bits.)"""
    x, r = randn(37, 96, dtype=np.float16), randn(37, 96, dtype=np.float16)
    w, b = randn(96, dtype=np.float16, shift=1.0), randn(96, dtype=np.float16)
    y_scale = np.float32(3.0 / (127 if q_dtype == 3 else 448))
    args, attrs = [x, w, b, r, y_scale], {"epsilon": 1e-5, "q_dtype": q_dtype}
    base = get_tactic("LayerNorm", "tensorkiln", "triton")
    want = base.fn(*(to_torch(a, DEVICE) for a in args), **attrs, _n_outputs=3)
    spec = spec_of("LayerNorm", "tensorkiln", args, attrs)
    plain = spec_of("LayerNorm", "tensorkiln", [x, w, b, r], {"epsilon": 1e-5})
    long_rows = [randn(2, 2048), randn(2048), randn(2048), randn(2, 2048), y_scale]
    for name in ("triton_r1w4", "triton_r4w4"):
        tiled = get_tactic("LayerNorm", "tensorkiln", name)
        assert tiled.applies(spec) and not tiled.applies(plain)
        got = tiled.fn(*(to_torch(a, DEVICE) for a in args), **attrs, _n_outputs=3)
        (y, q, s), (y0, q0, s0) = ([to_numpy(t) for t in ts] for ts in (got, want))
        assert y.dtype == y0.dtype and q.dtype == q0.dtype and s.dtype == s0.dtype
        if DEVICE == "cpu":
            for g, e in ((y, y0), (q, q0), (s, s0)):
                assert np.array_equal(g.view(np.uint8), e.view(np.uint8))
            continue
        np.testing.assert_allclose(y.astype(np.float32), y0.astype(np.float32), rtol=2e-3,
                                   atol=2e-3)  # fmt: skip
        np.testing.assert_array_equal(s, s0)  # (the residual sum: no reduction in it)
        qf, q0f = q.astype(np.float32), q0.astype(np.float32)
        step = (
            1.0 if q_dtype == 3 else 2.0 ** (np.floor(np.log2(np.maximum(np.abs(q0f), 2**-6))) - 3)
        )
        assert np.all(np.abs(qf - q0f) <= step), float(np.max(np.abs(qf - q0f) / step))
    # (4 rows of 2,048 values hold 8,192, past the 4,096 a program of these tiles holds)
    assert not get_tactic("LayerNorm", "tensorkiln", "triton_r4w4").applies(
        spec_of("LayerNorm", "tensorkiln", long_rows, attrs)
    )
    assert get_tactic("LayerNorm", "tensorkiln", "triton_r1w4").applies(
        spec_of("LayerNorm", "tensorkiln", long_rows, attrs)
    )
