"""The triton_flash Attention tactics (kernels/triton/flash_attention.py) against the numpy
reference attention, on fresh random inputs (through Triton's interpreter without a GPU).

Shapes are small but odd (sequence lengths past one block and not multiples of it, head widths
that are not powers of two); masks of every broadcast shape, bool and additive, with rows that see
no key; causal alone and with a mask; the "bsd" layouts; float16 and bfloat16.
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
from tests.kernels.triton import DEVICE  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
B, H, SQ, SK, D = 2, 2, 67, 75, 24
TACTIC = get_tactic("Attention", "tensorkiln", "triton_flash_m64")
TACTIC_128 = get_tactic("Attention", "tensorkiln", "triton_flash_m128")


def _mask(shape, kind, rng):
    hidden = rng.random(shape) < 0.4
    flat = hidden.reshape(-1, shape[-1])
    flat[:: max(1, len(flat) // 2)] = True  # some rows hide every key
    if kind == "bool":
        return ~hidden
    return np.where(hidden, -np.inf, rng.standard_normal(shape)).astype(np.float32)


def _run(args, attrs, dtype, tactic=None):
    """The tactic on ``args`` (numpy, float operands cast to ``dtype``) and the reference on the
    same values in float32; the relative L2 error."""
    narrow = [a.astype(dtype) if a.dtype == np.float32 else a for a in args]
    wide = [a.astype(np.float32) if a.dtype in (np.float16, BF16) else a for a in narrow]
    want = invoke(lookup("Attention", "tensorkiln", 1, "reference"), wide, attrs, 1)[0]
    spec = LayerSpec(
        "Attention", "tensorkiln", attrs, tuple(a.shape for a in narrow),
        tuple(a.dtype.name for a in narrow), device=DEVICE,
    )  # fmt: skip
    tactic = tactic or TACTIC
    assert tactic.applies(spec)
    got = to_numpy(tactic.fn(*(to_torch(a, DEVICE) for a in narrow), **attrs))
    assert got.shape == want.shape and got.dtype == dtype
    got = got.astype(np.float64)
    empty = (want == 0).all(axis=-1)
    assert not got[empty].any(), "a row that sees no key must be zeros"
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


def _qkv(rng, sq=SQ, sk=SK, d=D, dv=D):
    return [
        rng.standard_normal((B, H, n, w)).astype(np.float32)
        for n, w in ((sq, d), (sk, d), (sk, dv))
    ]


MASKS = [None, (B, 1, 1, SK), (B, H, SQ, SK), (SQ, SK), (B, 1, SQ, SK), (SK,)]


@pytest.mark.parametrize("kind", ["additive", "bool"])
@pytest.mark.parametrize(
    "shape", MASKS, ids=["none" if s is None else "x".join(map(str, s)) for s in MASKS]
)
def test_masks_of_every_broadcast_shape(shape, kind):
    rng = np.random.default_rng()
    args = _qkv(rng)
    attrs = {"scale": 0.3}
    if shape is not None:
        args.append(_mask(shape, kind, rng))
        attrs["mask_kind"] = kind
    elif kind == "bool":
        pytest.skip("no mask: one case is enough")
    assert _run(args, attrs, np.float16) < 1e-2


@pytest.mark.parametrize("name", ["triton_flash_m64", "triton_flash_m128", "triton_flash_m64_s3"])
@pytest.mark.parametrize("with_mask", [False, True], ids=["causal", "causal-and-mask"])
def test_causal_alone_and_with_a_mask(with_mask, name):
    tactic = get_tactic("Attention", "tensorkiln", name)
    rng = np.random.default_rng()
    args = _qkv(rng, sq=SK)  # causal top-left: square is the usual case
    attrs = {"causal": 1}
    if with_mask:
        args.append(_mask((B, 1, 1, SK), "additive", rng))
        attrs["mask_kind"] = "additive"
    assert _run(args, attrs, np.float16, tactic) < 1e-2
    args = _qkv(rng, sq=20, sk=SK)  # fewer queries than keys
    assert _run(args, {"causal": 1}, np.float16, tactic) < 1e-2


@pytest.mark.parametrize("name", ["triton_flash_m64", "triton_flash_m128"])
@pytest.mark.parametrize("causal", [0, 1])
def test_whole_key_blocks_and_the_edge_block(name, causal):
    """Key blocks every row of a query block sees whole run without the visibility test, the
    rest (the diagonal, the keys past the end) with it: several of each, for the two block
    heights, causal or not, with fewer and with more queries than keys."""
    tactic = get_tactic("Attention", "tensorkiln", name)
    rng = np.random.default_rng()
    for sq, sk in ((200, 200), (150, 230), (230, 150)):
        args = _qkv(rng, sq=sq, sk=sk)
        assert _run(args, {"causal": causal, "scale": 0.2}, np.float16, tactic) < 1e-2


@pytest.mark.parametrize("name", ["triton_flash_m64", "triton_flash_m128"])
@pytest.mark.parametrize("kind", ["additive", "-inf", "bool"])
@pytest.mark.parametrize("causal", [0, 1])
def test_a_key_padding_mask_over_whole_key_blocks(name, kind, causal):
    """A [B, 1, 1, Sk] mask (one row for every query: read as one vector a block, whole blocks
    without the per-score visibility test) over three whole blocks of keys and an edge block:
    random keys hidden, in batch 0 its whole first block hidden too, batch 2 sees no key at
    all (zeros), batch 3 sees every key; finite and infinite additive values and bool masks."""
    tactic = get_tactic("Attention", "tensorkiln", name)
    rng = np.random.default_rng()
    batch, sq, sk = 4, 150, 230
    args = [rng.standard_normal((batch, H, n, D)).astype(np.float32) for n in (sq, sk, sk)]
    hidden = rng.random((batch, 1, 1, sk)) < 0.3
    hidden[0, ..., :64] = True
    hidden[2] = True
    hidden[3] = False
    if kind == "bool":
        mask = ~hidden
    else:
        low = -np.inf if kind == "-inf" else np.finfo(np.float16).min
        mask = np.where(hidden, low, 0.5 * rng.standard_normal(hidden.shape)).astype(np.float32)
    attrs = {"mask_kind": "bool" if kind == "bool" else "additive", "scale": 0.25, "causal": causal}
    assert _run([*args, mask], attrs, np.float16, tactic) < 1e-2


def _hidden_triangle(s, batch=B):
    return np.triu(np.ones((s, s), bool), 1)[None, None].repeat(batch, axis=0)


@pytest.mark.parametrize("rows", [64, 128], ids=["m64", "m128"])
@pytest.mark.parametrize("kind", ["additive", "bool"])
def test_key_blocks_the_mask_hides_from_a_whole_query_block_are_skipped_exactly(kind, rows):
    """A causal triangle written into the mask (a decoder's export: finfo.min above the diagonal,
    no causal attribute), right padding in batch 1 (its last keys hidden from every row) and, in
    batch 0, rows that see no key: with a finite value their softmax still runs over every score
    (the additive rule), so their query block visits every key."""
    tactic = TACTIC if rows == 64 else TACTIC_128
    rng = np.random.default_rng()
    s = 200  # four blocks of 64 keys
    args = _qkv(rng, sq=s, sk=s)
    hidden = _hidden_triangle(s)
    hidden[1, :, :, 120:] = True  # right padding
    hidden[0, :, 10:40, :] = True  # blind rows
    if kind == "bool":
        args.append(~hidden)
    else:
        args.append(np.where(hidden, -60000.0, 0.0).astype(np.float32))
    assert _run(args, {"mask_kind": kind}, np.float16, tactic) < 1e-2


def test_short_sequences_of_a_padded_batch_skip_their_padding():
    rng = np.random.default_rng()
    s = 300
    args = _qkv(rng, sq=40, sk=s)
    lengths = rng.integers(1, s, B)
    pad = np.arange(s)[None, :] >= lengths[:, None]
    args.append(np.where(pad, -np.inf, 0.0)[:, None, None, :].astype(np.float32))
    assert _run(args, {"mask_kind": "additive", "scale": 0.2}, np.float16, TACTIC_128) < 1e-2


@pytest.mark.parametrize("kind", ["additive", "bool"])
def test_row_ends_against_numpy(kind):
    """The first pass on its own: one past each row's last visible key (every key for a row that
    sees none), against numpy; a broadcast axis is read once."""
    from tensorkiln.kernels.triton import flash_attention as flash

    rng = np.random.default_rng()
    sq, sk = 37, 290
    hidden = rng.random((2, 3, sq, sk)) < 0.97
    hidden[:, :, :, int(rng.integers(150, sk)) :] = True
    hidden[1, 2, 7, :] = True  # a row that sees nothing
    mask = ~hidden if kind == "bool" else np.where(hidden, -65504.0, 0.0).astype(np.float16)
    got, strides = flash._row_ends(to_torch(mask, DEVICE), kind == "bool")
    got = to_numpy(got)
    last = np.where((~hidden).any(-1), sk - np.argmax((~hidden)[..., ::-1], axis=-1), sk)
    np.testing.assert_array_equal(got, last)
    assert strides == (3 * sq, sq, 1)
    pad = to_torch(mask[:, :1, :1, :], DEVICE).expand(2, 3, sq, sk)  # [B, 1, 1, Sk] broadcast
    got, strides = flash._row_ends(pad, kind == "bool")
    assert tuple(got.shape) == (2, 1, 1) and strides == (1, 0, 0)
    np.testing.assert_array_equal(to_numpy(got).reshape(2), last[:, 0, 0])


SHORT = [
    "triton_flash_short_m64_x2",
    "triton_flash_short_m128_x1_s3",
    "triton_flash_short_m128_x2_s3",
]


@pytest.mark.parametrize("name", SHORT)
def test_short_sequences_on_the_persistent_kernel(name):
    """Keys in one block, each program looping over tiles (more tiles than programs: the
    interpreter's grid is 4 an SM's count): masks of every broadcast shape, bool and additive,
    with rows that see no key; causal alone and with a key padding mask; keys fewer than the
    block (75 of 128) and exactly one block (128), queries past a block height."""
    tactic = get_tactic("Attention", "tensorkiln", name)
    rng = np.random.default_rng()
    for shape in MASKS:
        for kind in ("additive", "bool") if shape is not None else ("",):
            args = _qkv(rng)
            attrs = {"scale": 0.3}
            if shape is not None:
                args.append(_mask(shape, kind, rng))
                attrs["mask_kind"] = kind
            assert _run(args, attrs, np.float16, tactic) < 1e-2, (shape, kind)
    for sq, sk in ((128, 128), (150, 128), (40, 75)):
        pad = _mask((B, 1, 1, sk), "additive", rng)
        for causal in (0, 1):
            args = [*_qkv(rng, sq=sq, sk=sk), pad]
            attrs = {"mask_kind": "additive", "causal": causal, "scale": 0.25}
            assert _run(args, attrs, np.float16, tactic) < 1e-2, (sq, sk, causal)
        assert _run(_qkv(rng, sq=sq, sk=sk), {}, BF16, tactic) < 2e-2


def test_the_persistent_kernel_takes_short_keys_only():
    tactic = get_tactic("Attention", "tensorkiln", SHORT[0])
    for sk, fits in ((128, True), (129, False)):
        spec = LayerSpec("Attention", "tensorkiln", {}, ((1, 2, 8, 16), (1, 2, sk, 16),
                         (1, 2, sk, 16)), ("float16",) * 3, device=DEVICE)  # fmt: skip
        assert tactic.applies(spec) == fits
    bsd = LayerSpec("Attention", "tensorkiln", {"num_heads": 2, "input_layout": "bsd"},
                    ((1, 8, 32), (1, 200, 32), (1, 200, 32)), ("float16",) * 3,
                    device=DEVICE)  # fmt: skip
    assert not tactic.applies(bsd)


def test_the_autotuner_times_the_short_kernel_beside_the_grid_kernel():
    # BERT's attention: [B, S, H*D] operands, S = 128; every short tactic survives the
    # per-source candidate limit, as do the grid kernel's four
    from tensorkiln.kernels.tactics import tactics_for
    from tensorkiln.tactics.autotune import TuneOptions, _prune

    attrs = {
        "num_heads": 12,
        "input_layout": "bsd",
        "output_layout": "bsd",
        "mask_kind": "additive",
    }
    spec = LayerSpec("Attention", "tensorkiln", attrs, ((64, 128, 768),) * 3 + ((64, 1, 1, 128),),
                     ("float16",) * 4, device=DEVICE)  # fmt: skip
    kept, _ = _prune(tactics_for("Attention", "tensorkiln", spec), spec,
                     TuneOptions().max_candidates)  # fmt: skip
    names = {t.name for t in kept}
    assert set(SHORT) <= names and "triton_flash_m64" in names


def test_bsd_layout_bfloat16_and_a_wider_value():
    rng = np.random.default_rng()
    heads, d = 3, 16
    q = rng.standard_normal((B, SQ, heads * d)).astype(np.float32)
    k = rng.standard_normal((B, SK, heads * d)).astype(np.float32)
    v = rng.standard_normal((B, SK, heads * 32)).astype(np.float32)
    pad = _mask((B, 1, 1, SK), "bool", rng)
    attrs = {"num_heads": heads, "input_layout": "bsd", "output_layout": "bsd", "mask_kind": "bool"}
    assert _run([q, k, v, pad], attrs, BF16) < 2e-2


def test_what_it_does_not_take():
    f32 = LayerSpec("Attention", "tensorkiln", {}, ((1, 2, 8, 16),) * 3, ("float32",) * 3,
                    device=DEVICE)  # fmt: skip
    assert not TACTIC.applies(f32)
    wide = LayerSpec("Attention", "tensorkiln", {}, ((1, 2, 8, 512),) * 3, ("float16",) * 3,
                     device=DEVICE)  # fmt: skip
    assert not TACTIC.applies(wide)
    cpu = LayerSpec("Attention", "tensorkiln", {}, ((1, 2, 8, 16),) * 3, ("float16",) * 3,
                    device="cpu")  # fmt: skip
    assert TACTIC.applies(cpu) == (DEVICE == "cpu")  # (CPU tensors only through the interpreter)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_bert_and_gpt2_shapes_on_the_gpu():
    """BERT's [B, 1, 1, S] padding mask at S=128 and GPT-2's causal-and-padding [B, 1, S, S] at
    S=512, head width 64, float16."""
    rng = np.random.default_rng()
    for s, shape, causal in ((128, (4, 1, 1, 128), 0), (512, (2, 1, 512, 512), 1)):
        q, k, v = (rng.standard_normal((shape[0], 12, s, 64)).astype(np.float32) for _ in range(3))
        mask = np.where(rng.random(shape) < 0.1, -np.inf, 0.0).astype(np.float32)
        attrs = {"mask_kind": "additive", "causal": causal}
        for tactic in (TACTIC, TACTIC_128):
            assert _run([q, k, v, mask], attrs, np.float16, tactic) < 1e-2
    # GPT-2's export: the triangle in the mask as float16's lowest value, no causal attribute
    q, k, v = (rng.standard_normal((2, 12, 512, 64)).astype(np.float32) for _ in range(3))
    mask = np.where(_hidden_triangle(512, 2), -65504.0, 0.0).astype(np.float32)
    for tactic in (TACTIC, TACTIC_128):
        assert _run([q, k, v, mask], {"mask_kind": "additive"}, np.float16, tactic) < 1e-2


@pytest.mark.parametrize("q_dtype", [3, 17], ids=["int8", "fp8"])
@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "key-padding"])
@pytest.mark.parametrize("layout", ["bhsd", "bsd"])
@pytest.mark.parametrize("name", ["triton_flash_m64", SHORT[1]])
def test_the_output_written_quantized_is_quantize_linear_of_the_float_one(
    q_dtype, masked, layout, name
):
    """With q_dtype and Y_scale the kernel's epilogue quantizes what it would have stored: the
    codes equal the reference QuantizeLinear of the same tactic's float16 output, bit for bit,
    including saturated values (the scale puts some outside the 8-bit range) and the zero rows
    of queries that see no key."""
    from tensorkiln.kernels.reference.quant import quantize_linear

    rng = np.random.default_rng()
    q, k, v = (a.astype(np.float16) for a in _qkv(rng))
    attrs = {"scale": 0.3}
    if layout == "bsd":  # [B, S, H*D] in and out, the heads split inside
        q, k, v = (a.transpose(0, 2, 1, 3).reshape(B, a.shape[2], H * D) for a in (q, k, v))
        attrs |= {"num_heads": H, "input_layout": "bsd", "output_layout": "bsd"}
    args = [q, k, v]
    if masked:  # batch 0 sees no key (zero rows), batch 1 has padding at the end
        pad = np.zeros((B, 1, 1, SK), np.float32)
        pad[0] = -np.inf
        pad[1, ..., rng.integers(SK // 2, SK - 1) :] = np.float32(np.finfo(np.float32).min)
        attrs["mask_kind"] = "additive"
        args.append(pad)
    tactic = get_tactic("Attention", "tensorkiln", name)
    device = [to_torch(a, DEVICE) for a in args]
    float_out = to_numpy(tactic.fn(*device, **attrs))
    top = 448.0 if q_dtype == 17 else 127.0
    y_scale = np.float32(np.abs(float_out.astype(np.float32)).max() / (top * 1.5))
    want = quantize_linear(float_out, y_scale, output_dtype=q_dtype)
    if not masked:
        device.append(None)
    got = to_numpy(tactic.fn(*device, to_torch(y_scale, DEVICE), **attrs, q_dtype=q_dtype))
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
    ratio = float_out.astype(np.float32) / y_scale
    bounds = {3: (-128.0, 127.0), 17: (-448.0, 448.0)}[q_dtype]
    codes = want.astype(np.float32)
    assert (np.abs(ratio) > top + 1).any()  # (the scale leaves some values out of range)
    assert (codes[ratio > top + 1] == bounds[1]).all()
    assert (codes[ratio < bounds[0] - 1] == bounds[0]).all()
