"""The CUTLASS FP8 tactics' CPU side: the kernel library's manifest is read defensively (every
malformed field a KernelError naming the file), and the layers the tactics claim are the ones
their kernels compute (E4M3 or int8 operands, a packed weight, an 8-bit output of the operands'
type, ReLU or none, 1x1 convolutions of stride 1 or 2 and in FP8 with a quantized residual,
shapes the kernels assume). The kernels themselves
run in tests/gpu/test_cutlass_fp8_gpu.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")

from tensorkiln.errors import KernelError
from tensorkiln.kernels.cuda import cutlass_fp8 as cf
from tensorkiln.kernels.tactics import LayerSpec

E4M3 = "float8_e4m3fn"


def _kernel(
    epilogue: str, act: str, tile: tuple[int, int], out: str = "fp8", a: str = "fp8", **extra
) -> dict:
    occupancy, k_steps = extra.get("occupancy", 1), extra.get("k_steps", 4)
    name = f"gemm_{a}_{out}_{epilogue}_{act}_{tile[0]}x{tile[1]}o{occupancy}k{k_steps}"
    tensors = {t: [2, 2] for t in ("a", "b", "c", *(("res",) if epilogue == "residual" else ()))}
    return {"name": name, "entry": f"_mlir_{name}__mlir_ciface_x", "a": a, "c": out,
            "epilogue": epilogue, "activation": act, "tile": list(tile), "tensors": tensors,
            **extra}  # fmt: skip


def _library(tmp_path: Path, kernels: list[dict], library: str = "libk.so") -> Path:
    (tmp_path / "libk.so").write_bytes(b"\x7fELF")  # (read_manifest does not load it)
    (tmp_path / cf.MANIFEST).write_text(json.dumps({"library": library, "kernels": kernels}))
    return tmp_path


def _conv_kernel(
    geometry: str, act: str, tile: tuple[int, int], a: str = "fp8", epilogue: str = "channel",
    **extra,
) -> dict:  # fmt: skip
    """A convolution's kernel as the build writes it: A the NHWC input (four extents and
    strides), the window, padding and stride in ``conv``."""
    k = _kernel(epilogue, act, tile, out=a, a=a, **extra)
    k["name"] = f"conv{geometry}_{k['name'].removeprefix('gemm_')}"
    k["tensors"]["a"] = [4, 4]
    window = int(geometry[0])
    k["conv"] = [window, window // 2, int(geometry[-1])]
    return k


KERNELS = [
    _kernel("channel", "relu", (128, 128)),
    _kernel("channel", "none", (128, 256)),
    _kernel("residual", "relu", (128, 256)),
    _kernel("residual", "relu", (128, 64)),
    _kernel("channel", "relu", (128, 64), k_steps=2),  # (K = 64 only)
    _kernel("channel", "gelu", (128, 256), post_scale=True),  # (QGemmAct's GELU)
    _kernel("channel", "gelu_tanh", (128, 64), post_scale=True),  # (GELU on the hardware's tanh)
    _kernel("channel", "none", (128, 128), out="f16"),  # (a float16 output)
    _kernel("channel", "gelu", (128, 128), out="i8", a="i8", post_scale=True),  # (int8)
    _kernel("channel", "none", (128, 64), out="f16", a="i8"),
    _kernel("residual", "relu", (128, 256), out="f16"),  # (a last block's float16 sum)
    _kernel("residual", "relu", (128, 64), out="f16", a="i8"),
]


def test_a_well_formed_manifest_is_read(tmp_path: Path) -> None:
    lib, kernels = cf.read_manifest(_library(tmp_path, KERNELS))
    assert lib == (tmp_path / "libk.so").resolve()
    assert sorted(kernels) == sorted(k["name"] for k in KERNELS)


def test_kernels_the_tactics_do_not_use_are_passed_over(tmp_path: Path) -> None:
    # what a default build also writes: fp16 kernels, scalar epilogues, GELU through erf, and
    # what an older build wrote: GELU scaled before the activation
    others = [
        {**_kernel("channel", "relu", (128, 64)), "name": "gemm_f16_f16_scalar_relu_128x64o1k4"},
        {**_kernel("channel", "relu", (128, 64)), "name": "gemm_fp8_fp8_scalar_relu_128x64o2k2"},
        {**_kernel("channel", "relu", (128, 64)), "name": "gemm_fp8_fp8_channel_gelu_128x64o1k4"},
        {
            **_kernel("channel", "relu", (128, 64)),
            "name": "gemm_fp8_fp8_channel_gelu_erf_64x256o1k4",
        },
        _kernel("channel", "gelu", (64, 128)),
        _kernel("channel", "gelu", (64, 256), post_scale=False),
        _kernel("channel", "gelu", (128, 64), out="f16", post_scale=True),
        _kernel("channel", "none", (128, 64), out="fp8", a="i8"),  # (int8 in, E4M3 out)
        _kernel("channel", "none", (128, 64), out="i8", a="fp8"),
        # (one main-loop stage: the example's loop would wait on it for the next K tile)
        {**_kernel("residual", "relu", (128, 128), occupancy=2), "ab_stages": 1},
    ]
    _, kernels = cf.read_manifest(_library(tmp_path, [*KERNELS, *others]))
    assert sorted(kernels) == sorted(k["name"] for k in KERNELS)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.update(library="../libk.so"), "must name a .so file in the folder"),
        (lambda d: d.update(library="/tmp/libk.so"), "must name a .so file in the folder"),
        (lambda d: d.update(library="other.so"), "is not a file in"),
        (lambda d: d.update(kernels={}), "'kernels' list"),
        (lambda d: d["kernels"][0].update(name="gemm; rm -rf"), "is not an exported GEMM"),
        (lambda d: d["kernels"][0].update(name=None), "is not an exported GEMM"),
        (lambda d: d["kernels"][0].update(entry="system"), "is not an exported kernel's"),
        (lambda d: d["kernels"][0].update(tile=[96, 128]), "is not one of M"),
        (lambda d: d["kernels"][0].update(c="f16"), "do not match the name"),
        (lambda d: d["kernels"][2]["tensors"].pop("res"), "are not the dynamic ones it takes"),
        (lambda d: d["kernels"].append(7), "expected an object"),
        (lambda d: d["kernels"][0].update(sha256="../x"), "is not a hexadecimal digest"),
        (lambda d: d["kernels"][0].update(sha256=12), "is not a hexadecimal digest"),
        (lambda d: d["kernels"][0].update(residual_buffers=2), "is not 1, or 2 for a residual"),
        (lambda d: d["kernels"][2].update(residual_buffers=3), "is not 1, or 2 for a residual"),
        (lambda d: d["kernels"][2].update(ab_stages="2"), "is not a count of main-loop stages"),
    ],
)
def test_a_malformed_manifest_is_a_clear_error(tmp_path: Path, change, message: str) -> None:
    doc = {"library": "libk.so", "kernels": json.loads(json.dumps(KERNELS))}
    change(doc)
    (tmp_path / "libk.so").write_bytes(b"\x7fELF")
    (tmp_path / cf.MANIFEST).write_text(json.dumps(doc))
    with pytest.raises(KernelError, match=message) as err:
        cf.read_manifest(tmp_path)
    assert "manifest.json" in str(err.value)


def test_missing_oversized_and_non_json_manifests(tmp_path: Path, monkeypatch) -> None:
    with pytest.raises(KernelError, match="cannot read it"):
        cf.read_manifest(tmp_path)
    (tmp_path / cf.MANIFEST).write_text("{not json")
    with pytest.raises(KernelError, match="not JSON"):
        cf.read_manifest(tmp_path)
    monkeypatch.setattr(cf, "_MANIFEST_LIMIT", 8)
    (tmp_path / cf.MANIFEST).write_text(json.dumps({"library": "x.so", "kernels": []}))
    with pytest.raises(KernelError, match="more than a manifest's"):
        cf.read_manifest(tmp_path)


class _Loaded:
    def __init__(self, folder: Path) -> None:
        self.kernels = cf.read_manifest(folder)[1]


def _gemm(m=256, n=128, k=256, *, act="Relu", y=True, out=17, dtype=E4M3, trans_b=1, bias=True):
    shapes = ((m, k), (), (n, k), (n,), (n,) if bias else None, () if y else None)
    dtypes = (dtype, "float32", dtype, "float32", "float32" if bias else None, "float32")
    attrs = {"activation": act, "transB": trans_b, "out_dtype": out}
    return LayerSpec("QGemmAct", "tensorkiln", attrs, shapes, dtypes)


def _conv(n=2, c=64, m=256, hw=16, *, k=1, residual=True, strides=(1, 1), act="Relu", pads=None,
          dtype=E4M3, out_dtype=17, y=True):  # fmt: skip
    out = -(-hw // strides[0])
    z = (n, m, out, out) if residual else None
    shapes = ((n, c, hw, hw), (), (m, c, k, k), (m,), (m,), z, () if y else None,
              () if residual else None)  # fmt: skip
    dtypes = (dtype, "float32", dtype, "float32", "float32", dtype if residual else None,
              "float32", "float32" if residual else None)  # fmt: skip
    attrs = {"activation": act, "out_dtype": out_dtype, "strides": list(strides), "group": 1}
    if pads is not None:
        attrs["pads"] = list(pads)
    return LayerSpec("QConvAct", "tensorkiln", attrs, shapes, dtypes)


def _names(spec: LayerSpec) -> list[str]:
    return sorted(n.removeprefix(cf.PREFIX) for n in cf._kernels_for(spec))


def test_the_layers_the_kernels_compute(tmp_path: Path, monkeypatch) -> None:
    loaded = _Loaded(_library(tmp_path, KERNELS))
    monkeypatch.setattr(cf, "library", lambda: loaded)
    relu = ["gemm_fp8_fp8_channel_relu_128x128o1k4"]
    assert _names(_gemm()) == relu
    assert _names(_gemm(act="")) == ["gemm_fp8_fp8_channel_none_128x256o1k4"]
    assert _names(_gemm(k=64)) == sorted([*relu, "gemm_fp8_fp8_channel_relu_128x64o1k2"])
    assert _names(_gemm(act="Gelu")) == [
        "gemm_fp8_fp8_channel_gelu_128x256o1k4", "gemm_fp8_fp8_channel_gelu_tanh_128x64o1k4"
    ]  # fmt: skip
    # a float16 output without an activation: the 16-bit kernel
    assert _names(_gemm(y=False, out=10, act="")) == ["gemm_fp8_f16_channel_none_128x128o1k4"]
    # int8 operands: the int8 kernels, an int8 output with GELU or a float16 one
    assert _names(_gemm(dtype="int8", act="Gelu", out=3)) == ["gemm_i8_i8_channel_gelu_128x128o1k4"]
    assert _names(_gemm(dtype="int8", y=False, out=10, act="")) == [
        "gemm_i8_f16_channel_none_128x64o1k4"
    ]
    for spec in (_gemm(dtype="int8", act="Gelu", out=17), _gemm(dtype="int8", act="", out=3),
                 _gemm(act="Gelu", out=3)):  # fmt: skip
        assert _names(spec) == []
    assert _names(_gemm(y=False, out=10, act="", bias=False)) == [
        "gemm_fp8_f16_channel_none_128x128o1k4"
    ]
    # not theirs: another activation, a float32 or bfloat16 output or one with an activation,
    # an unpacked weight, odd shapes
    for spec in (_gemm(act="Sigmoid"), _gemm(act="GeluTanh"), _gemm(y=False, out=10),
                 _gemm(y=False, out=1, act=""), _gemm(y=False, out=16, act=""),
                 _gemm(dtype="int8"),
                 _gemm(trans_b=0), _gemm(m=200), _gemm(n=120), _gemm(k=72)):  # fmt: skip
        assert _names(spec) == []
    assert _names(_gemm(bias=False)) == relu
    cpu = _gemm()
    assert cf._kernels_for(LayerSpec(cpu.op, cpu.domain, cpu.attrs, cpu.shapes, cpu.dtypes,
                                     device="cpu")) == []  # fmt: skip

    # 1x1 convolutions: the residual kernels whose tile divides the problem
    assert _names(_conv()) == [
        "gemm_fp8_fp8_residual_relu_128x256o1k4", "gemm_fp8_fp8_residual_relu_128x64o1k4",
    ]  # fmt: skip
    assert _names(_conv(m=64)) == ["gemm_fp8_fp8_residual_relu_128x64o1k4"]
    assert _names(_conv(residual=False, c=128)) == relu
    assert _names(_conv(residual=False)) == sorted([*relu, "gemm_fp8_fp8_channel_relu_128x64o1k2"])
    # stride 2 (a ResNet's downsampling shortcut): the GEMM of every other row and column
    assert _names(_conv(strides=(2, 2), hw=32)) == _names(_conv())
    for spec in (_conv(k=3), _conv(strides=(2, 2), pads=(1, 1, 1, 1)), _conv(act="Sigmoid"),
                 _conv(hw=7), _conv(act="Gelu", residual=False)):  # fmt: skip
        assert _names(spec) == []
    # with ReLU and the 8-bit residual, writing float16 (a last block's sum, a float pool after
    # it): the 16-bit residual kernels of the operands' type, undivided by a Y_scale
    assert _names(_conv(y=False, out_dtype=10)) == ["gemm_fp8_f16_residual_relu_128x256o1k4"]
    assert _names(_conv(y=False, out_dtype=10, dtype="int8")) == [
        "gemm_i8_f16_residual_relu_128x64o1k4"
    ]
    for spec in (_conv(y=False, out_dtype=10, residual=False), _conv(y=False, out_dtype=1),
                 _conv(out_dtype=10), _conv(y=False, out_dtype=17)):  # fmt: skip
        assert _names(spec) == []


def test_int8_pointwise_convolutions_take_the_int8_kernels(tmp_path: Path, monkeypatch) -> None:
    """int8 1x1 convolutions writing int8 (ReLU or none, stride 1 or 2, an int8 residual or
    none) run the int8 kernels; not a layer whose output or residual type is not its
    operands'."""
    kernels = [
        _kernel("channel", "relu", (128, 128), out="i8", a="i8"),
        _kernel("channel", "none", (128, 256), out="i8", a="i8"),
        _kernel("residual", "relu", (128, 128), out="i8", a="i8"),
        _kernel("channel", "relu", (128, 64)),
        _kernel("residual", "relu", (128, 64)),
    ]
    loaded = _Loaded(_library(tmp_path, kernels))
    monkeypatch.setattr(cf, "library", lambda: loaded)

    def int8(**kw) -> LayerSpec:
        return _conv(dtype="int8", out_dtype=3, residual=False, **kw)

    assert _names(int8()) == ["gemm_i8_i8_channel_relu_128x128o1k4"]
    assert _names(int8(act="")) == ["gemm_i8_i8_channel_none_128x256o1k4"]
    assert _names(int8(strides=(2, 2), hw=32)) == ["gemm_i8_i8_channel_relu_128x128o1k4"]
    assert _names(_conv(dtype="int8", out_dtype=3)) == ["gemm_i8_i8_residual_relu_128x128o1k4"]
    assert _names(_conv(dtype="int8", out_dtype=17, residual=False)) == []
    assert _names(_conv(residual=False)) == ["gemm_fp8_fp8_channel_relu_128x64o1k4"]
    assert _names(_conv()) == ["gemm_fp8_fp8_residual_relu_128x64o1k4"]
    mixed = _conv(dtype="int8", out_dtype=3)  # (an E4M3 residual to an int8 layer)
    mixed = LayerSpec(mixed.op, mixed.domain, mixed.attrs, mixed.shapes,
                      (*mixed.dtypes[:5], E4M3, *mixed.dtypes[6:]))  # fmt: skip
    assert _names(mixed) == []


def test_no_library_no_candidates(monkeypatch) -> None:
    monkeypatch.delenv(cf.ENV, raising=False)
    cf._state.clear()
    assert cf.library() is None
    assert cf._kernels_for(_gemm()) == []
    resolve = cf._resolver("QGemmAct", cf._gemm_fn)
    assert resolve(cf.PREFIX + "gemm_fp8_fp8_channel_relu_128x128o1k4") is None


def test_the_estimate_ranks_fitting_tiles_first(tmp_path: Path, monkeypatch) -> None:
    kernels = [
        _kernel("channel", "relu", t, occupancy=o)
        for t, o in (((128, 64), 2), ((128, 128), 2), ((128, 256), 1), ((64, 256), 1))
    ]
    loaded = _Loaded(_library(tmp_path, kernels))
    monkeypatch.setattr(cf, "library", lambda: loaded)
    resolve = cf._resolver("QGemmAct", cf._gemm_fn)

    def ranked(spec: LayerSpec) -> list[str]:
        tactics = [resolve(n) for n in cf._kernels_for(spec)]
        return [t.name.rsplit("_", 1)[1] for t in sorted(tactics, key=lambda t: -t.score(spec))]

    assert ranked(_gemm(n=64))[0] == "128x64o2k4"  # (the only tile that wastes no columns)
    # GELU on tanh (faster on the H200 than the polynomial at every tile timed) ranks first
    gelu = [_kernel("channel", act, t, occupancy=o, post_scale=True)
            for act in ("gelu", "gelu_tanh") for t, o in (((128, 128), 2), ((128, 256), 1))]  # fmt: skip
    loaded.kernels = cf.read_manifest(_library(tmp_path, gelu))[1]
    order = [t.name for t in sorted((resolve(n) for n in cf._kernels_for(_gemm(n=3072, act="Gelu"))),
                                    key=lambda t: -t.score(_gemm(n=3072, act="Gelu")))]  # fmt: skip
    assert [n.split("channel_")[1] for n in order[:2]] == ["gelu_tanh_128x128o2k4",
                                                          "gelu_tanh_128x256o1k4"]  # fmt: skip
    loaded.kernels = cf.read_manifest(_library(tmp_path, kernels))[1]
    assert ranked(_gemm(n=128))[:2] == ["128x128o2k4", "128x64o2k4"]
    assert ranked(_gemm(n=256))[-1] == "64x256o1k4"
    for name in cf._kernels_for(_gemm()):
        # (at an engine's other shapes, M = 200 among them, the tactic runs the exact kernel)
        assert resolve(name).supports(_gemm()) and resolve(name).supports(_gemm(m=200))
        assert not resolve(name).supports(_gemm(act="Sigmoid"))
        assert not resolve(name).supports(_gemm(y=False, out=10))


def test_a_kernels_digest_is_its_tactics_version(tmp_path: Path, monkeypatch) -> None:
    """The build records each kernel's object-code digest; the tactic carries it as its version
    (the timing cache's key), and a library without digests gives tactics without one."""
    digest = "0123456789abcdef" * 4
    kernels = [
        _kernel("residual", "relu", (128, 128), occupancy=2, sha256=digest, residual_buffers=2),
        _kernel("residual", "relu", (128, 64)),
    ]
    kernels[0]["name"] += "vd"
    kernels[0]["entry"] = f"_mlir_{kernels[0]['name']}__mlir_ciface_x"
    loaded = _Loaded(_library(tmp_path, kernels))
    monkeypatch.setattr(cf, "library", lambda: loaded)
    resolve = cf._resolver("QGemmAct", cf._gemm_fn)
    assert resolve(cf.PREFIX + kernels[0]["name"]).version == digest
    assert resolve(cf.PREFIX + kernels[1]["name"]).version is None


def test_a_tactic_timed_at_one_shape_applies_at_a_dynamic_batch_of_one(
    tmp_path: Path, monkeypatch
) -> None:
    """ResNet-50's 1x1 convolutions at batch 256 are the kernels' (M = 256 x 56 x 56), at batch
    1 not (3,136 pixels): the autotuner keeps a tactic only where it applies at every shape an
    engine runs at, so the tactic applies at both and runs the exact kernel at the second."""
    loaded = _Loaded(_library(tmp_path, KERNELS))
    monkeypatch.setattr(cf, "library", lambda: loaded)
    big, one = _conv(n=256, hw=56, c=64), _conv(n=1, hw=56, c=64)
    names = cf._kernels_for(big)
    assert names and cf._kernels_for(one) == []  # (timed at the shape the kernels take)
    resolve = cf._resolver("QConvAct", cf._conv_fn)
    for name in names:
        assert resolve(name).applies(big) and resolve(name).applies(one)


class _Recording:
    """A stand-in library: records what a tactic hands its kernel (the GPU runs the real one)."""

    def __init__(self, epilogue: str, activation: str = "relu", out: str = "fp8") -> None:
        self.kernels = {"k": {"epilogue": epilogue, "activation": activation, "c": out}}
        self.calls: list[tuple] = []

    def run(self, name, a, b, d, col, bias, z=None, z_scale=0.0) -> None:
        self.calls.append((a, b, *_columns(col, bias, d.shape[1]), z, z_scale))
        d.zero_()


def _columns(col, bias, n: int) -> tuple:
    """The epilogue's vectors as a kernel reads them: N columns, then zeros to a whole number of
    the widest tile's columns (a tile wider than N reads past N)."""
    for v in (col, bias):
        assert v.shape[0] % 256 == 0 and v.shape[0] >= n and not bool(v[n:].any())
    return col[:n], bias[:n]


def test_the_epilogue_a_conv_layer_hands_its_kernel(monkeypatch) -> None:
    import torch

    from tensorkiln.kernels.cuda.convert import mark_constant

    lib = _Recording("residual")
    monkeypatch.setattr(cf, "library", lambda: lib)
    g = torch.Generator().manual_seed(5)
    e4m3 = torch.float8_e4m3fn
    x = torch.randn(2, 16, 8, 8, generator=g).to(e4m3).contiguous(memory_format=torch.channels_last)
    w = torch.randn(32, 16, 1, 1, generator=g).to(e4m3)
    z = torch.randn(2, 32, 8, 8, generator=g).to(e4m3)
    x_scale, y_scale, z_scale = torch.tensor(0.04), torch.tensor(0.05), torch.tensor(0.1)
    w_scale = 0.01 + 0.02 * torch.rand(32, generator=g)
    bias = torch.randn(32, generator=g)
    for t in (x_scale, y_scale, z_scale, w_scale, bias):
        mark_constant(t)  # (an engine's constants: what the tactic makes of them is kept)
    fn = cf._conv_fn("k")
    for _ in range(2):  # (the second call takes the vectors kept from the first)
        y = fn(x, x_scale, w, w_scale, bias, z, y_scale, z_scale, activation="Relu", out_dtype=17)
    assert y.shape == (2, 32, 8, 8) and y.dtype == e4m3
    assert y.is_contiguous(memory_format=torch.channels_last)
    (a, b, col, shift, z2, zs), again = lib.calls
    assert again[2].data_ptr() == col.data_ptr() and again[3].data_ptr() == shift.data_ptr()
    assert torch.equal(a.float(), x.permute(0, 2, 3, 1).reshape(128, 16).float())
    assert torch.equal(b.float(), w.reshape(32, 16).float())
    assert torch.equal(z2.float(), z.permute(0, 2, 3, 1).reshape(128, 32).float())
    want = x_scale.double() * w_scale.double() / y_scale.double()
    torch.testing.assert_close(col.double(), want, rtol=1e-6, atol=0)
    torch.testing.assert_close(shift.double(), bias.double() / 0.05, rtol=1e-6, atol=0)
    assert zs == pytest.approx(0.1 / 0.05, rel=1e-6)


def test_a_float16_residual_conv_layer_hands_its_kernel_undivided_scales(monkeypatch) -> None:
    """A 1x1 convolution with ReLU and an 8-bit residual writing float16 (no Y_scale): its
    kernel gets ``X_scale * W_scale[n]``, the bias and ``Z_scale`` as they are, and a float16
    output; an 8-bit layer handed to it is refused, not run wrongly."""
    import torch

    lib = _Recording("residual", out="f16")
    monkeypatch.setattr(cf, "library", lambda: lib)
    g = torch.Generator().manual_seed(9)
    e4m3 = torch.float8_e4m3fn
    x = torch.randn(2, 16, 8, 8, generator=g).to(e4m3).contiguous(memory_format=torch.channels_last)
    w = torch.randn(32, 16, 1, 1, generator=g).to(e4m3)
    z = torch.randn(2, 32, 8, 8, generator=g).to(e4m3).contiguous(memory_format=torch.channels_last)
    x_scale, z_scale = torch.tensor(0.04), torch.tensor(0.1)
    w_scale = 0.01 + 0.02 * torch.rand(32, generator=g)
    bias = torch.randn(32, generator=g)
    y = cf._conv_fn("k")(x, x_scale, w, w_scale, bias, z, None, z_scale, activation="Relu",
                         out_dtype=10)  # fmt: skip
    assert y.shape == (2, 32, 8, 8) and y.dtype == torch.float16
    assert y.is_contiguous(memory_format=torch.channels_last)
    ((a, _, col, shift, z2, zs),) = lib.calls
    assert torch.equal(a.float(), x.float().permute(0, 2, 3, 1).reshape(128, 16))
    assert torch.equal(z2.float(), z.float().permute(0, 2, 3, 1).reshape(128, 32))
    torch.testing.assert_close(col.double(), x_scale.double() * w_scale.double(), rtol=1e-6, atol=0)
    torch.testing.assert_close(shift.double(), bias.double(), rtol=1e-6, atol=0)
    assert zs == pytest.approx(0.1, rel=1e-6)
    with pytest.raises(KernelError, match=r"writes torch\.float16"):
        cf._conv_fn("k")(x, x_scale, w, w_scale, bias, z, torch.tensor(0.05), z_scale,
                         activation="Relu", out_dtype=17)  # fmt: skip


def test_a_strided_conv_layer_hands_its_kernel_the_pixels_it_reads(monkeypatch) -> None:
    """A 1x1 convolution of stride 2 (a ResNet stage's shortcut) is the GEMM of every other row
    and column of its input: those pixels, as rows, and the residual of the output's size."""
    import torch

    lib = _Recording("residual")
    monkeypatch.setattr(cf, "library", lambda: lib)
    e4m3 = torch.float8_e4m3fn
    x = torch.randn(2, 16, 15, 16).to(e4m3).contiguous(memory_format=torch.channels_last)
    w = torch.randn(32, 16, 1, 1).to(e4m3)
    z = torch.randn(2, 32, 8, 8).to(e4m3).contiguous(memory_format=torch.channels_last)
    scales = (torch.tensor(0.04), torch.tensor(0.05), torch.tensor(0.1))
    w_scale = 0.01 + 0.02 * torch.rand(32)
    y = cf._conv_fn("k")(x, scales[0], w, w_scale, torch.randn(32), z, scales[1], scales[2],
                         activation="Relu", out_dtype=17, strides=[2, 2])  # fmt: skip
    assert y.shape == (2, 32, 8, 8) and y.is_contiguous(memory_format=torch.channels_last)
    ((a, _, _, _, z2, _),) = lib.calls
    picked = x[:, :, ::2, ::2].float().permute(0, 2, 3, 1).reshape(128, 16)
    assert torch.equal(a.float(), picked)
    assert torch.equal(z2.float(), z.float().permute(0, 2, 3, 1).reshape(128, 32))


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_the_epilogue_a_gemm_hands_its_kernel(monkeypatch, activation: str) -> None:
    """ReLU commutes with the output's 1 / Y_scale, so it goes into the vectors; GELU does not,
    so a GELU kernel takes the vectors without it and 1 / Y_scale after the activation."""
    import torch

    from tensorkiln.kernels.cuda.convert import mark_constant

    lib = _Recording("channel", activation)
    monkeypatch.setattr(cf, "library", lambda: lib)
    g = torch.Generator().manual_seed(6)
    e4m3 = torch.float8_e4m3fn
    a = torch.randn(2, 128, 32, generator=g).to(e4m3)
    b = torch.randn(48, 32, generator=g).to(e4m3)
    a_scale, y_scale = torch.tensor(0.04), torch.tensor(0.05)
    b_scale = 0.01 + 0.02 * torch.rand(48, generator=g)
    c = torch.randn(48, generator=g)
    for t in (a_scale, y_scale, b_scale, c):
        mark_constant(t)
    act = {"relu": "Relu", "gelu": "Gelu"}[activation]
    attrs = {"transB": 1, "activation": act, "out_dtype": 17, "alpha": 0.5, "beta": 0.25}
    y = cf._gemm_fn("k")(a, a_scale, b, b_scale, c, y_scale, **attrs)
    assert y.shape == (2, 128, 48) and y.dtype == e4m3
    ((a2, b2, col, shift, z2, scalar),) = lib.calls
    assert torch.equal(a2.float(), a.reshape(256, 32).float()) and z2 is None
    assert torch.equal(b2.float(), b.float())
    over = 1.0 / 0.05 if activation == "relu" else 1.0
    want = 0.5 * a_scale.double() * b_scale.double() * over
    torch.testing.assert_close(col.double(), want, rtol=1e-6, atol=0)
    torch.testing.assert_close(shift.double(), 0.25 * c.double() * over, rtol=1e-6, atol=0)
    assert scalar == (pytest.approx(1.0 / 0.05, rel=1e-6) if activation == "gelu" else 0.0)


def test_a_float16_output_takes_the_scales_undivided(monkeypatch) -> None:
    """A GEMM that writes float16 (no Y_scale, no activation) hands its kernel ``alpha *
    X_scale * W_scale[n]`` and ``beta * B[n]`` and a float16 output; a layer with a Y_scale or
    an activation is refused by that kernel rather than run wrongly."""
    import torch

    from tensorkiln.kernels.cuda.convert import mark_constant

    lib = _Recording("channel", "none", out="f16")
    monkeypatch.setattr(cf, "library", lambda: lib)
    g = torch.Generator().manual_seed(7)
    e4m3 = torch.float8_e4m3fn
    a = torch.randn(128, 32, generator=g).to(e4m3)
    b = torch.randn(48, 32, generator=g).to(e4m3)
    a_scale = torch.tensor(0.01 + 0.05 * torch.rand(1, generator=g).item())
    b_scale = 0.01 + 0.02 * torch.rand(48, generator=g)
    c = torch.randn(48, generator=g)
    for t in (a_scale, b_scale, c):
        mark_constant(t)
    attrs = {"transB": 1, "activation": "", "out_dtype": 10, "alpha": 0.5, "beta": 0.25}
    y = cf._gemm_fn("k")(a, a_scale, b, b_scale, c, None, **attrs)
    assert y.shape == (128, 48) and y.dtype == torch.float16
    ((a2, b2, col, shift, z2, scalar),) = lib.calls
    assert torch.equal(a2.float(), a.float()) and torch.equal(b2.float(), b.float())
    want = 0.5 * a_scale.double() * b_scale.double()
    torch.testing.assert_close(col.double(), want, rtol=1e-6, atol=0)
    torch.testing.assert_close(shift.double(), 0.25 * c.double(), rtol=1e-6, atol=0)
    assert z2 is None and scalar == 0.0
    with pytest.raises(KernelError, match="not a packed 8-bit layer"):
        cf._gemm_fn("k")(
            a, a_scale, b, b_scale, c, torch.tensor(0.05), **{**attrs, "out_dtype": 17}
        )
    with pytest.raises(KernelError, match="without an activation"):
        cf._gemm_fn("k")(a, a_scale, b, b_scale, c, None, **{**attrs, "activation": "Relu"})


def test_a_cluster_kernel_takes_only_shapes_its_clusters_cover(tmp_path: Path, monkeypatch) -> None:
    """Two CTAs along N share A's loads: the pair's kernel is listed (and ranked first) where N
    holds whole pairs of its tiles, not elsewhere; at a shape of that kind an engine meets later,
    the tactic runs the exact kernel instead of launching it."""
    import torch

    from tensorkiln.kernels.cuda.convert import mark_constant

    pair = {**_kernel("channel", "relu", (128, 128), occupancy=2, cluster=[1, 2]),
            "name": "gemm_fp8_fp8_channel_relu_128x128o2k4c1x2"}  # fmt: skip
    single = _kernel("channel", "relu", (128, 128), occupancy=2)
    loaded = _Loaded(_library(tmp_path, [pair, single]))
    monkeypatch.setattr(cf, "library", lambda: loaded)
    assert _names(_gemm(n=256)) == sorted([pair["name"], single["name"]])
    assert _names(_gemm(n=384)) == [single["name"]]  # (three tiles: the last pair half empty)
    resolve = cf._resolver("QGemmAct", cf._gemm_fn)
    spec = _gemm(n=768)
    ranked = sorted((resolve(n) for n in cf._kernels_for(spec)), key=lambda t: -t.score(spec))
    assert ranked[0].name == cf.PREFIX + pair["name"]
    assert resolve(cf.PREFIX + pair["name"]).applies(_gemm(n=384))  # (there: the exact kernel)
    for bad in ([1, 3], [2], "1x2"):
        doc = [{**pair, "cluster": bad}]
        with pytest.raises(KernelError, match="cluster"):
            cf.read_manifest(_library(tmp_path, doc))

    lib = _Recording("channel")
    lib.kernels["k"].update(tile=[128, 128], cluster=[1, 2])
    monkeypatch.setattr(cf, "library", lambda: lib)
    g = torch.Generator().manual_seed(8)
    e4m3 = torch.float8_e4m3fn
    a = torch.randn(128, 32, generator=g).to(e4m3)
    b = torch.randn(384, 32, generator=g).to(e4m3)
    a_scale, y_scale = torch.tensor(0.04), torch.tensor(0.05)
    b_scale = 0.01 + 0.02 * torch.rand(384, generator=g)
    for t in (a_scale, y_scale, b_scale):
        mark_constant(t)
    attrs = {"transB": 1, "activation": "Relu", "out_dtype": 17}
    y = cf._gemm_fn("k")(a, a_scale, b, b_scale, None, y_scale, **attrs)
    assert lib.calls == []  # (N = 384: not whole pairs of 128-column tiles)
    want = cf.qgemm_act(a, a_scale, b, b_scale, None, y_scale, **attrs)
    assert y.dtype == e4m3 and torch.equal(y.float(), want.float())
    lib.kernels["k"]["cluster"] = [1, 1]
    cf._gemm_fn("k")(a, a_scale, b, b_scale, None, y_scale, **attrs)
    assert len(lib.calls) == 1


CONV_KERNELS = [
    _conv_kernel("3x3s1", "relu", (128, 64), k_steps=2),  # (64-byte K steps: 64 channels)
    _conv_kernel("3x3s1", "relu", (128, 128)),  # (128-byte K steps: 128 channels and more)
    _conv_kernel("3x3s2", "relu", (128, 128)),
    _conv_kernel("1x1s2", "none", (128, 256)),
    _conv_kernel("1x1s2", "relu", (128, 128), epilogue="residual"),
    _conv_kernel("3x3s1", "relu", (128, 128), a="i8"),
]


def test_conv_kernels_are_read_and_checked(tmp_path: Path) -> None:
    _, kernels = cf.read_manifest(_library(tmp_path, [*KERNELS, *CONV_KERNELS]))
    assert sorted(kernels) == sorted(k["name"] for k in (*KERNELS, *CONV_KERNELS))
    bad = [
        ({"conv": [3, 1, 2]}, "does not match the name"),  # (another stride than the name's)
        ({"conv": None}, "does not match the name"),
        ({"tensors": {"a": [2, 2], "b": [2, 2], "c": [2, 2]}}, "not the dynamic ones"),
        ({"cluster": [1, 2]}, "not a convolution's kernel"),
    ]
    for change, message in bad:
        with pytest.raises(KernelError, match=message):
            cf.read_manifest(_library(tmp_path, [{**CONV_KERNELS[1], **change}]))
    wrong = {**CONV_KERNELS[1], "c": "f16"}
    wrong["name"] = wrong["name"].replace("_fp8_fp8_", "_fp8_f16_")
    with pytest.raises(KernelError, match="not a convolution's kernel"):
        cf.read_manifest(_library(tmp_path, [wrong]))  # (8 bits out only)


def test_the_convolutions_the_conv_kernels_take(tmp_path: Path, monkeypatch) -> None:
    """A conv kernel takes the convolutions of its geometry (3x3 padded by 1, stride 1 or 2 on
    an even image; 1x1 of stride 2), of its types, with no residual, where its K steps stay
    within one tap; a 1x1 of stride 2 is the GEMM kernels' too (of every other pixel)."""
    loaded = _Loaded(_library(tmp_path, [*KERNELS, *CONV_KERNELS]))
    monkeypatch.setattr(cf, "library", lambda: loaded)
    three = {"k": 3, "residual": False, "pads": (1, 1, 1, 1)}
    assert _names(_conv(c=64, **three)) == ["conv3x3s1_fp8_fp8_channel_relu_128x64o1k2"]
    assert _names(_conv(c=128, **three)) == [
        "conv3x3s1_fp8_fp8_channel_relu_128x128o1k4", "conv3x3s1_fp8_fp8_channel_relu_128x64o1k2",
    ]  # fmt: skip
    assert _names(_conv(c=128, strides=(2, 2), hw=32, **three)) == [
        "conv3x3s2_fp8_fp8_channel_relu_128x128o1k4"
    ]
    assert _names(_conv(c=128, dtype="int8", out_dtype=3, **three)) == [
        "conv3x3s1_i8_i8_channel_relu_128x128o1k4"
    ]
    same = _conv(c=128, k=3, residual=False)
    same = LayerSpec(same.op, same.domain, {**same.attrs, "auto_pad": "SAME_UPPER"}, same.shapes,
                     same.dtypes)  # fmt: skip
    assert _names(same) == _names(_conv(c=128, **three))
    assert "conv1x1s2_fp8_fp8_channel_none_128x256o1k4" in _names(
        _conv(c=128, strides=(2, 2), hw=32, act="", residual=False)
    )
    # a stage's shortcut with the block's residual (a quantized engine adds it there): the
    # residual conv kernel as well as the GEMM's residual kernels
    shortcut = _names(_conv(c=128, strides=(2, 2), hw=32))
    assert "conv1x1s2_fp8_fp8_residual_relu_128x128o1k4" in shortcut
    assert "gemm_fp8_fp8_residual_relu_128x256o1k4" in shortcut
    # not theirs: a residual (no 3x3 residual kernel here), another padding, odd images at
    # stride 2, channels of no K step, a float16 output, another activation
    for spec in (_conv(c=128, k=3, pads=(1, 1, 1, 1)), _conv(c=128, k=3, residual=False),
                 _conv(c=128, k=3, residual=False, pads=(0, 0, 1, 1)),
                 _conv(c=128, strides=(2, 2), hw=15, **three), _conv(c=48, **three),
                 _conv(c=128, out_dtype=10, **three), _conv(c=128, act="Sigmoid", **three)):  # fmt: skip
        assert not [n for n in _names(spec) if n.startswith("conv")]


def _within_one_step(got, want) -> None:
    """Equal E4M3 codes, or one step apart where the float32 scales' rounding lands a value on
    the other side of a rounding boundary."""
    import torch

    g, w = got.double(), want.double()
    step = torch.exp2(torch.floor(torch.log2(torch.maximum(g.abs(), w.abs()).clamp_min(2**-6))) - 3)
    assert bool(((g - w).abs() <= step).all())
    assert float((g != w).double().mean()) < 0.01  # (almost all the same code)


class _Im2col:
    """A stand-in library for a conv kernel: computes what the kernel is specified to compute
    from the operands it is handed (A an NHWC image, B (out channels, KH x KW x C) with the
    channels fastest, then the window's column, then its row; zeros outside the image), in
    float64, and records them."""

    def __init__(self, window: int, stride: int, epilogue: str = "channel") -> None:
        name = f"conv{window}x{window}s{stride}"
        self.kernels = {name: {"epilogue": epilogue, "activation": "relu", "c": "fp8",
                               "a": "fp8", "conv": [window, window // 2, stride],
                               "tile": [128, 128], "k_steps": 2}}  # fmt: skip
        self.name, self.window, self.stride = name, window, stride
        self.calls: list[tuple] = []

    def run(self, name, a, b, d, col, bias, z=None, z_scale=0.0) -> None:
        import torch

        nb, h, w, c = a.shape
        k, pad, s = self.window, self.window // 2, self.stride
        padded = torch.zeros(nb, h + 2 * pad, w + 2 * pad, c, dtype=torch.float64)
        padded[:, pad : pad + h, pad : pad + w] = a.double()
        oh, ow = (h + 2 * pad - k) // s + 1, (w + 2 * pad - k) // s + 1
        taps = [padded[:, r : r + s * (oh - 1) + 1 : s, q : q + s * (ow - 1) + 1 : s]
                for r in range(k) for q in range(k)]  # fmt: skip
        rows = torch.cat(taps, dim=3).reshape(nb * oh * ow, k * k * c)
        acc = rows @ b.double().T
        col, bias = _columns(col, bias, d.shape[1])
        v = acc * col.double() + bias.double()
        if z is not None:  # (the residual: rows of the output's shape, times its scale)
            v = v + z.double() * z_scale
        d.copy_(torch.relu(v).to(d.dtype))
        self.calls.append((a, b, col, bias, acc))


@pytest.mark.parametrize(("window", "stride"), [(3, 1), (3, 2), (1, 2)])
def test_a_conv_kernel_is_handed_the_convolution(monkeypatch, window: int, stride: int) -> None:
    """What the tactic hands a conv kernel describes the layer's convolution: the im2col sums
    of its operands equal torch's convolution of the layer's input and weight (exactly: E4M3
    products and their sums are exact in float64), the epilogue vectors are the layer's scales
    and bias over Y_scale, and the output comes back channels-last in the layer's shape."""
    import torch
    import torch.nn.functional as F

    lib = _Im2col(window, stride)
    monkeypatch.setattr(cf, "library", lambda: lib)
    g = torch.Generator().manual_seed(11 + window + stride)
    e4m3 = torch.float8_e4m3fn
    x = (
        torch.randn(2, 64, 16, 16, generator=g)
        .to(e4m3)
        .contiguous(memory_format=torch.channels_last)
    )
    w = torch.randn(96, 64, window, window, generator=g).to(e4m3)
    x_scale, y_scale = torch.tensor(0.04), torch.tensor(0.5)
    w_scale = 0.01 + 0.02 * torch.rand(96, generator=g)
    bias = torch.randn(96, generator=g)
    pads = [window // 2] * 4
    y = cf._conv_fn(lib.name)(x, x_scale, w, w_scale, bias, None, y_scale, None,
                              activation="Relu", out_dtype=17, strides=[stride] * 2, pads=pads)  # fmt: skip
    ((a, _, col, shift, acc),) = lib.calls
    assert a.shape == (2, 16, 16, 64) and a.is_contiguous()  # (the NHWC input itself)
    want = F.conv2d(x.double(), w.double(), stride=stride, padding=window // 2)
    oh = want.shape[2]
    assert y.shape == want.shape and y.dtype == e4m3
    assert y.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(acc, want.permute(0, 2, 3, 1).reshape(2 * oh * oh, 96))
    scale = (x_scale.double() * w_scale.double() / y_scale.double()).reshape(1, 96, 1, 1)
    expected = torch.relu(want * scale + (bias.double() / 0.5).reshape(1, 96, 1, 1))
    _within_one_step(y, expected.to(e4m3))
    torch.testing.assert_close(shift.double(), bias.double() / 0.5, rtol=1e-6, atol=0)
    torch.testing.assert_close(col.double(), scale.reshape(96), rtol=1e-6, atol=0)


def test_a_conv_kernel_at_a_shape_it_does_not_take_runs_the_exact_kernel(monkeypatch) -> None:
    """At an engine's other shapes (a batch whose pixels are not a multiple of 128 here) the
    tactic runs the exact default kernel, and nothing reaches the library."""
    import torch
    import torch.nn.functional as F

    lib = _Im2col(3, 1)
    monkeypatch.setattr(cf, "library", lambda: lib)
    e4m3 = torch.float8_e4m3fn
    x = torch.randn(1, 64, 5, 5).to(e4m3)
    w = torch.randn(32, 64, 3, 3).to(e4m3)
    scales = (torch.tensor(0.04), 0.01 + 0.02 * torch.rand(32), torch.tensor(0.5))
    y = cf._conv_fn(lib.name)(x, scales[0], w, scales[1], None, None, scales[2], None,
                              activation="Relu", out_dtype=17, pads=[1, 1, 1, 1])  # fmt: skip
    assert lib.calls == [] and y.shape == (1, 32, 5, 5)
    ref = F.conv2d(x.double(), w.double(), padding=1)
    ref = ref * (0.04 * scales[1].double() / 0.5).reshape(1, 32, 1, 1)
    torch.testing.assert_close(y.double(), torch.relu(ref).to(e4m3).double(), rtol=0.07, atol=0.01)


def test_a_residual_conv_kernel_is_handed_the_residual(monkeypatch) -> None:
    """A stride-2 shortcut that adds the block's 8-bit residual: the kernel gets the residual
    as rows of the output's pixels and its scale over Y_scale, and what comes back is the
    layer's: ReLU(conv * scale + bias + Z * Z_scale) / Y_scale, computed here from torch's
    convolution in float64."""
    import torch
    import torch.nn.functional as F

    lib = _Im2col(1, 2, "residual")
    monkeypatch.setattr(cf, "library", lambda: lib)
    g = torch.Generator().manual_seed(31)
    e4m3, cl = torch.float8_e4m3fn, torch.channels_last
    x = torch.randn(2, 64, 16, 16, generator=g).to(e4m3).contiguous(memory_format=cl)
    w = torch.randn(128, 64, 1, 1, generator=g).to(e4m3)
    z = torch.randn(2, 128, 8, 8, generator=g).to(e4m3).contiguous(memory_format=cl)
    x_scale, y_scale, z_scale = torch.tensor(0.04), torch.tensor(0.5), torch.tensor(0.25)
    w_scale = 0.01 + 0.02 * torch.rand(128, generator=g)
    bias = torch.randn(128, generator=g)
    y = cf._conv_fn(lib.name)(x, x_scale, w, w_scale, bias, z, y_scale, z_scale,
                              activation="Relu", out_dtype=17, strides=[2, 2])  # fmt: skip
    assert len(lib.calls) == 1 and y.shape == (2, 128, 8, 8)
    conv = F.conv2d(x.double(), w.double(), stride=2)
    v = conv * (0.04 * w_scale.double() / 0.5).reshape(1, 128, 1, 1)
    v = v + (bias.double() / 0.5).reshape(1, 128, 1, 1) + z.double() * (0.25 / 0.5)
    _within_one_step(y, torch.relu(v).to(e4m3))
    # a residual kernel without a residual (another layer): the exact kernel, not the library
    cf._conv_fn(lib.name)(x, x_scale, w, w_scale, bias, None, y_scale, None,
                          activation="Relu", out_dtype=17, strides=[2, 2])  # fmt: skip
    assert len(lib.calls) == 1


def _a_tile_and_its_variant(tmp_path: Path, monkeypatch, suffix: str, **flag) -> tuple:
    """A library of one 128x64 GEMM kernel and the same tile with ``flag`` (its name ending in
    ``suffix``): (the kernel, the variant, the GEMM tactics' resolver)."""
    plain = _kernel("channel", "relu", (128, 64))
    variant = {**_kernel("channel", "relu", (128, 64)), **flag}
    variant["name"] += suffix
    loaded = _Loaded(_library(tmp_path, [plain, variant]))
    monkeypatch.setattr(cf, "library", lambda: loaded)
    return plain, variant, cf._resolver("QGemmAct", cf._gemm_fn)


def test_promoted_kernels_rank_first_only_over_a_long_k(tmp_path: Path, monkeypatch) -> None:
    """Kernels that promote their E4M3 sums every K step are slower, but over a long K they are
    the ones whose outputs pass the autotuner's check: there they rank first, elsewhere last."""
    plain, promoted, resolve = _a_tile_and_its_variant(tmp_path, monkeypatch, "p", promote=True)

    def first(spec: LayerSpec) -> str:
        tactics = [resolve(n) for n in cf._kernels_for(spec)]
        assert len(tactics) == 2
        return max(tactics, key=lambda t: t.score(spec)).name.removeprefix(cf.PREFIX)

    assert first(_gemm(n=64, k=4608)) == promoted["name"]
    assert first(_gemm(n=64, k=256)) == plain["name"]


def test_staged_vector_kernels_rank_first_where_k_is_short(tmp_path: Path, monkeypatch) -> None:
    """A memory-bound layer (short K) ranks the tile that stages its epilogue's vectors in shared
    memory before the same tile reading them from global memory; a long K does not care."""
    plain, staged, resolve = _a_tile_and_its_variant(
        tmp_path, monkeypatch, "v", vectors_in_smem=True
    )
    scores = {n: resolve(n).score(_gemm(n=64, k=256)) for n in cf._kernels_for(_gemm(n=64, k=256))}
    assert max(scores, key=scores.get) == cf.PREFIX + staged["name"]
    long_k = _gemm(n=64, k=4096)
    assert resolve(cf.PREFIX + staged["name"]).score(long_k) == resolve(
        cf.PREFIX + plain["name"]
    ).score(long_k)


def test_a_conv_kernels_input_is_passed_as_its_image() -> None:
    """A conv kernel's A argument: N, H, W, C and the strides of N, D (= 1), H and W of a dense
    NHWC tensor, as the exported kernel declares them (four dynamic extents and strides); a
    tensor that is not dense is refused, not read with the wrong strides."""
    import torch

    t = torch.zeros(3, 5, 7, 32, dtype=torch.int8)
    arg = cf.image_arg(t)
    assert arg.data == t.data_ptr()
    assert list(arg.shapes) == [3, 5, 7, 32]
    assert list(arg.strides) == [5 * 7 * 32, 5 * 7 * 32, 7 * 32, 32]
    assert list(t.stride()[:3]) == [arg.strides[0], arg.strides[2], arg.strides[3]]
    with pytest.raises(KernelError, match="dense NHWC"):
        cf.image_arg(t.permute(0, 2, 1, 3))


def test_a_kernel_that_does_not_load_is_left_out_not_the_library(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    """One kernel of a few hundred that does not load (a damaged or foreign object) is left out
    with a warning naming it; the rest stay candidates. A library none of whose kernels loads is
    a clear error."""
    folder = _library(tmp_path, KERNELS[:3])
    monkeypatch.setattr(cf, "load_cudart", lambda: None)
    monkeypatch.setattr(cf.ctypes, "CDLL", lambda *a, **k: object())
    bad = KERNELS[1]["name"]

    def load(lib, name, entry, where):
        if name == bad:
            raise KernelError(f"{where}: {name} did not load (CUDA error 200)")
        return object()

    monkeypatch.setattr(cf, "load_kernel", load)
    with caplog.at_level("WARNING"):
        lib = cf.Library(folder)
    assert sorted(lib.kernels) == sorted(k["name"] for k in (KERNELS[0], KERNELS[2]))
    assert bad in caplog.text and "1 of its kernels left out" in caplog.text

    def none(lib, name, entry, where):
        raise KernelError(f"{where}: {name} did not load (CUDA error 209)")

    monkeypatch.setattr(cf, "load_kernel", none)
    with pytest.raises(KernelError, match="none of its 3 kernels loads"):
        cf.Library(folder)
