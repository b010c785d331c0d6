"""cuBLASLt algorithm tactics (kernels/cuda/cublaslt.py).

Without a GPU: how the operands are handed to column-major cuBLAS, checked by reading each
operand's memory the way cuBLAS does (numpy over the tensor's storage) and multiplying, against
numpy's product of the row-major matrices; and the tactics' constraint checks. On a GPU: every
algorithm tactic against PyTorch in float32, in eager calls and inside a CUDA graph.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tensorkiln.kernels.cuda import cublaslt
from tensorkiln.kernels.tactics import LayerSpec, get_tactic, tactics_for


def _column_major(t: torch.Tensor, op: int, rows: int, cols: int, ld: int) -> np.ndarray:
    """The matrix cuBLAS reads from ``t``'s memory: (rows, cols) column-major with leading
    dimension ``ld`` from the tensor's first element, transposed where ``op`` says so."""
    memory = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage())  # the whole buffer
    flat = memory.float().numpy()[t.storage_offset() :]
    base = np.lib.stride_tricks.as_strided(
        flat, shape=(rows, cols), strides=(flat.itemsize, ld * flat.itemsize)
    )
    return base.T if op == 1 else base


def _operands(rng, m: int, k: int, n: int, layout_a: str, layout_b: str):
    """(a (M, K), b (K, N)) as row-major, transposed views, or row slices of wider buffers."""

    def make(r: int, c: int, layout: str) -> torch.Tensor:
        if layout == "row":
            return torch.from_numpy(rng.standard_normal((r, c)).astype(np.float16))
        if layout == "col":  # a transposed view: (c, r) contiguous, read as (r, c)
            return torch.from_numpy(rng.standard_normal((c, r)).astype(np.float16)).T
        wide = torch.from_numpy(rng.standard_normal((r, c + 8)).astype(np.float16))
        return wide[:, :c]  # row-major, leading dimension c + 8

    return make(m, k, layout_a), make(k, n, layout_b)


@pytest.mark.parametrize("layout_a", ["row", "col", "padded"])
@pytest.mark.parametrize("layout_b", ["row", "col", "padded"])
def test_column_major_reading_is_the_product(layout_a: str, layout_b: str) -> None:
    rng = np.random.default_rng()
    m, k, n = (int(x) for x in rng.integers(3, 40, 3))
    a, b = _operands(rng, m, k, n, layout_a, layout_b)
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float16))
    key = cublaslt.problem(a, b, bias, "Relu")
    assert key is not None
    dtype, w, x, (rows_d, cols_d), epilogue, aligns = key
    assert dtype is torch.float16 and (rows_d, cols_d) == (n, m) and epilogue == 6
    # cuBLAS computes D (N, M) column-major = op(A) @ op(B) with A = b's memory, B = a's
    mat_a = _column_major(b, *w)
    mat_b = _column_major(a, *x)
    assert mat_a.shape == (n, k) and mat_b.shape == (k, m)
    d_col_major = mat_a @ mat_b
    # ... which, read row-major, is a @ b
    want = a.float().numpy() @ b.float().numpy()
    np.testing.assert_allclose(d_col_major.T, want, rtol=1e-5, atol=1e-4)
    assert all(al & (al - 1) == 0 and 2 <= al <= 256 for al in aligns)


def test_what_cublaslt_does_not_take() -> None:
    rng = np.random.default_rng()
    a, b = _operands(rng, 8, 16, 12, "row", "row")
    assert cublaslt.problem(a.float(), b.float(), None, "") is None  # 32-bit: torch's GEMM
    assert cublaslt.problem(a, b, None, "Sigmoid") is None  # no such epilogue
    assert cublaslt.problem(a, b, torch.ones(8, 12, dtype=torch.float16), "") is None  # not a row
    strided = torch.from_numpy(rng.standard_normal((8, 32)).astype(np.float16))[:, ::2]
    assert cublaslt.problem(strided, b, None, "") is None  # neither row- nor column-major
    # and on the CPU the family names no candidates
    spec = LayerSpec(
        "GemmAct", "tensorkiln", {}, ((8, 16), (16, 12), (12,)), ("float16",) * 3, "cpu"
    )
    names = [t.name for t in tactics_for("GemmAct", "tensorkiln", spec)]
    assert not [n for n in names if cublaslt.parse_name(n)]


def test_algorithm_names_round_trip() -> None:
    rng = np.random.default_rng()
    algo = cublaslt._Algo()
    for i in range(5):  # (the rest zeros, as in real algorithms)
        algo.data[i] = int(rng.integers(1, 1 << 62))
    name = cublaslt.algorithm_name(algo, 130100)
    assert name.startswith("cublaslt_130100_")
    assert cublaslt.parse_name(name) == (130100, bytes(algo))
    for bad in ("cublaslt_1_zz", "cublaslt_1_" + "ab" * 65, "cublaslt_x_00", "cublaslt_1_"):
        assert cublaslt.parse_name(bad) is None
        assert get_tactic("GemmAct", "tensorkiln", bad) is None
    # a name from an engine resolves to a tactic of its own group; from another cuBLASLt
    # version (here: any, without a GPU) its bytes are not used: the heuristic's first runs
    t = get_tactic("GemmAct", "tensorkiln", name)
    assert t is not None and t.name == name and t.group == name
    assert get_tactic("GemmAct", "tensorkiln", "cublaslt_gelu_tanh").group is None


def _gpu() -> None:
    if not torch.cuda.is_available() or cublaslt.library() is None:
        pytest.skip("needs a CUDA GPU with cuBLASLt")


def _activate(y: torch.Tensor, act: str) -> torch.Tensor:
    if act == "Relu":
        return torch.relu(y)
    if act == "GeluTanh":
        return torch.nn.functional.gelu(y, approximate="tanh")
    return y


CASES = [
    # (M, K, N, transB, activation, bias, dtype)
    (512, 256, 384, 0, "", True, torch.float16),
    (1000, 768, 768, 1, "", True, torch.float16),
    (640, 512, 1024, 0, "Relu", True, torch.bfloat16),
    (256, 384, 512, 1, "GeluTanh", True, torch.float16),
    (300, 200, 136, 0, "", False, torch.float16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}x{c[2]}-{c[4] or 'none'}")
def test_every_algorithm_agrees_with_pytorch(case) -> None:
    _gpu()
    m, k, n, trans_b, act, has_bias, dtype = case
    gen = torch.Generator(device="cuda").manual_seed(int(np.random.default_rng().integers(1 << 31)))
    a = torch.randn(m, k, device="cuda", dtype=dtype, generator=gen)
    w = torch.randn(n, k, device="cuda", dtype=dtype, generator=gen) / k**0.5
    b = w.T if trans_b else w.T.contiguous()
    bias = torch.randn(n, device="cuda", dtype=dtype, generator=gen) if has_bias else None
    want = _activate(a.float() @ b.float() + (bias.float() if has_bias else 0), act)
    scale = want.abs().max().item()
    key = cublaslt.problem(a, b, bias, act)
    plan, _ = cublaslt._plan(key, torch.cuda.current_device())
    assert plan.algos
    for algo in [None, *(bytes(x) for x in plan.algos)]:
        got = cublaslt.matmul(a, b, bias, 1.0, act, algo)
        assert got is not None and got.shape == (m, n) and got.dtype == dtype
        err = (got.float() - want).abs().max().item() / scale
        assert err < 1e-2, (algo, err)
    # the algorithm a layer was tuned with, run at other row counts (checked, or the first)
    for rows in (m // 2 + 1, 3 * m):
        a2 = torch.randn(rows, k, device="cuda", dtype=dtype, generator=gen)
        want2 = _activate(a2.float() @ b.float() + (bias.float() if has_bias else 0), act)
        got = cublaslt.matmul(a2, b, bias, 1.0, act, bytes(plan.algos[-1]))
        err = (got.float() - want2).abs().max().item() / want2.abs().max().item()
        assert err < 1e-2, (rows, err)


@pytest.mark.gpu
def test_algorithm_tactic_in_a_cuda_graph() -> None:
    _gpu()
    spec = LayerSpec(
        "GemmAct", "tensorkiln", {"transB": 1, "activation": "Relu"},
        ((384, 256), (512, 256), (512,)), ("float16",) * 3, "cuda",
    )  # fmt: skip
    names = [t.name for t in tactics_for("GemmAct", "tensorkiln", spec)]
    found = [n for n in names if cublaslt.parse_name(n)]
    assert found, names
    fn = get_tactic("GemmAct", "tensorkiln", found[-1]).fn
    a = torch.randn(384, 256, device="cuda", dtype=torch.float16)
    w = torch.randn(512, 256, device="cuda", dtype=torch.float16) / 16
    bias = torch.randn(512, device="cuda", dtype=torch.float16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(a, w, bias, transB=1, activation="Relu")
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(a, w, bias, transB=1, activation="Relu")
    a.copy_(torch.randn_like(a))
    graph.replay()
    torch.cuda.synchronize()
    want = torch.relu(a.float() @ w.float().T + bias.float())
    err = (out.float() - want).abs().max().item() / want.abs().max().item()
    assert err < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("has_bias", [True, False])
def test_a_residual_goes_in_as_c(has_bias: bool) -> None:
    """A GemmAct's residual Z read as cuBLASLt's C (beta 1) beside the bias epilogue: every
    algorithm's a @ b + bias + z against PyTorch in float32, through the algorithm tactic (a
    3-D A, as BERT's GEMMs read the tokens); a residual cuBLASLt cannot take as C (another
    dtype, a strided view) is added after the product instead, with the same result."""
    _gpu()
    gen = torch.Generator(device="cuda").manual_seed(int(np.random.default_rng().integers(1 << 31)))
    m, k, n = 384, 256, 512
    a = torch.randn(m, k, device="cuda", dtype=torch.float16, generator=gen)
    w = torch.randn(n, k, device="cuda", dtype=torch.float16, generator=gen) / k**0.5
    bias = torch.randn(n, device="cuda", dtype=torch.float16, generator=gen) if has_bias else None
    z = torch.randn(m, n, device="cuda", dtype=torch.float16, generator=gen)
    want = a.float() @ w.float().T + (bias.float() if has_bias else 0) + z.float()
    scale = want.abs().max().item()
    key = cublaslt.problem(a, w.T, bias, "")
    plan, _ = cublaslt._plan(key, torch.cuda.current_device())
    assert plan.algos
    for algo in [None, *(bytes(x) for x in plan.algos)]:
        got = cublaslt.matmul(a, w.T, bias, 1.0, "", algo, residual=z)
        assert got is not None and got.shape == (m, n)
        assert (got.float() - want).abs().max().item() / scale < 1e-2, algo
    assert cublaslt.matmul(a, w.T, bias, 1.0, "", None, residual=z[:, : n // 2]) is None
    assert cublaslt.matmul(a, w.T, bias, 1.0, "Relu", None, residual=z) is None
    spec = LayerSpec(
        "GemmAct", "tensorkiln", {"transB": 1},
        ((2, m // 2, k), (n, k), (n,), (2, m // 2, n)), ("float16",) * 4, "cuda",
    )  # fmt: skip
    names = [t.name for t in tactics_for("GemmAct", "tensorkiln", spec)]
    found = [x for x in names if cublaslt.parse_name(x)]
    assert found, names
    fn = get_tactic("GemmAct", "tensorkiln", found[0]).fn
    c = bias if has_bias else torch.zeros(n, device="cuda", dtype=torch.float16)
    want3 = want.reshape(2, m // 2, n)
    for residual in (z, z.float(), torch.cat([z, z], 1)[:, :n]):  # (C as is; cast; strided)
        got = fn(a.reshape(2, m // 2, k), w, c, residual.reshape(2, m // 2, n), transB=1)
        assert got.shape == (2, m // 2, n)
        assert (got.float() - want3).abs().max().item() / scale < 1e-2


def test_fp8_matmul_refuses_what_it_cannot_take() -> None:
    """On the CPU, or with operands other than E4M3, an E4M3 output without its scale: None
    (the caller computes it otherwise), never a wrong answer."""
    a = torch.zeros((32, 32)).to(torch.float8_e4m3fn)
    one = torch.ones(1)
    assert cublaslt.fp8_matmul(a, a, one, one) is None  # (a CPU tensor)
    assert cublaslt.fp8_matmul(a.float(), a.float(), one, one) is None
    assert cublaslt.fp8_matmul(a, a, one, one, out_dtype=torch.float8_e4m3fn) is None


FP8_CASES = [  # (M, N, K, activation, output)
    (256, 128, 64, "", "fp16"),
    (512, 256, 128, "Relu", "fp16"),
    (384, 192, 256, "GeluTanh", "bf16"),
    (256, 128, 64, "Relu", "e4m3"),
    (512, 256, 192, "GeluTanh", "e4m3"),
]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case", FP8_CASES, ids=lambda c: f"{c[0]}x{c[1]}x{c[2]}-{c[3] or 'bias'}-{c[4]}"
)
@pytest.mark.parametrize("fast", [False, True])
def test_fp8_matmul_agrees_with_the_exact_product(case, fast: bool) -> None:
    """cuBLASLt's FP8 GEMM with the bias, the activation and the output quantization in its
    epilogue, against float64 from the same E4M3 operands: 16-bit outputs to 1e-2 relative L2,
    E4M3 outputs within one step of the output's largest value."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need a GPU of compute capability 8.9 or later")
    m, n, k, act, out = case
    g = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    a = (torch.randn(m, k, generator=g) * 4).to("cuda", torch.float8_e4m3fn)
    w = (torch.randn(n, k, generator=g) * 4).to("cuda", torch.float8_e4m3fn)
    xs = torch.rand(1, generator=g).cuda() * 0.1 + 0.01
    ws = torch.rand(1, generator=g).cuda() * 0.1 + 0.01
    c_dtype = torch.bfloat16 if out == "bf16" else torch.float16
    bias = torch.randn(n, generator=g).to("cuda", c_dtype)
    exact = (a.double() @ w.double().T) * float(xs) * float(ws) + bias.double()
    if act == "Relu":
        exact = torch.relu(exact)
    elif act == "GeluTanh":
        exact = torch.nn.functional.gelu(exact, approximate="tanh")
    out_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn}[out]
    y_scale = None
    if out == "e4m3":
        y_scale = torch.tensor([float(exact.abs().max()) / 448.0], device="cuda")
    y = cublaslt.fp8_matmul(
        a, w, xs, ws, bias=bias, activation=act, out_dtype=out_dtype, y_scale=y_scale,
        fast_accum=fast,
    )  # fmt: skip
    assert y is not None and y.shape == (m, n) and y.dtype == out_dtype
    if y_scale is None:
        err = float((y.double() - exact).norm() / exact.norm())
        assert err <= 1e-2, err
    else:  # (E4M3's step at the largest value, 448, is 32: one step of the range)
        err = float((y.double() * float(y_scale) - exact).abs().max())
        assert err <= 32.0 * float(y_scale), (err, float(y_scale))
