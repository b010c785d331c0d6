"""Padding removal (passes/remove_padding.py, BuilderConfig.remove_padding, --remove-padding).

Real exports (a small Hugging Face BERT with a dynamic batch axis, torch's MultiheadAttention with
a key_padding_mask, GPT-2's causal mask) are built with and without it; the packed engines must
agree with onnxruntime at every position the mask keeps and give zeros at the others, on masks
drawn fresh (right padding of every length, holes, an empty sequence). Graphs that do not qualify
are left as they are, with a note saying why. The kernels are checked against numpy written here.
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxruntime")
pytest.importorskip("transformers")

from tensorkiln.builder import Builder, BuilderConfig  # noqa: E402
from tensorkiln.kernels.common.packing import tokens_hint  # noqa: E402
from tensorkiln.kernels.cuda import packing as cuda_packing  # noqa: E402
from tensorkiln.kernels.reference import packing as ref_packing  # noqa: E402
from tests.models.test_architectures import (  # noqa: E402
    _no_mha_fastpath,
    build_bert,
    build_gpt2,
    run_onnxruntime,
)
from tests.passes.test_fuse_mha import _export as export_mha  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
SEQ = 16


def _export(model, feeds: dict, path, outputs: list[str]):
    axes = {k: {0: "batch"} for k in (*feeds, *outputs)}
    with warnings.catch_warnings(), _no_mha_fastpath(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model, tuple(torch.from_numpy(v) for v in feeds.values()), str(path),
            input_names=list(feeds), output_names=outputs, dynamic_axes=axes, opset_version=17,
            dynamo=False,
        )  # fmt: skip
    return path


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    model, feeds = build_bert()
    path = tmp_path_factory.mktemp("bert") / "bert.onnx"
    return _export(model, feeds, path, ["hidden", "pooled"])


def _masks(rng: np.random.Generator, batch: int, seq: int) -> list[np.ndarray]:
    """Right padding of random lengths (one empty, one full), then random holes."""
    right = np.zeros((batch, seq), np.int64)
    lengths = rng.integers(1, seq, batch)
    lengths[0], lengths[-1] = 0, seq
    for i, n in enumerate(lengths):
        right[i, :n] = 1
    holes = (rng.random((batch, seq)) < 0.7).astype(np.int64)
    holes[:, 0] = 1
    return [right, holes]


def _build(path, backend: str, packed: bool, level: int = 3):
    config = BuilderConfig()
    config.remove_padding = packed
    config.optimization_level = level
    builder = Builder(backend)
    engine = builder.build(path, config, progress=False)
    return engine, builder.last_report


def _ops(engine) -> list[str]:
    return [n.op for n in engine.graph.nodes]


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_bert_packed_agrees_with_onnxruntime_where_the_mask_keeps(bert, backend: str) -> None:
    engine, report = _build(bert, backend, packed=True)
    assert report.passes.get("remove_padding", 0) > 0, report.notes
    assert any("padding removed" in n for n in report.notes)
    ops = _ops(engine)
    assert "PackedAttention" in ops and "Attention" not in ops
    assert ops.count("PackIndex") == 1
    ctx = engine.create_execution_context()
    rng = np.random.default_rng()
    for mask in _masks(rng, 5, SEQ):
        feeds = {"input_ids": rng.integers(0, 1000, mask.shape), "attention_mask": mask}
        want = run_onnxruntime(bert, feeds)
        got = ctx.infer(feeds)
        keep = mask != 0
        hidden = got["hidden"]
        scale = np.abs(want[0][keep]).max()
        np.testing.assert_allclose(hidden[keep], want[0][keep], rtol=1e-4, atol=1e-4 * scale)
        assert not hidden[~keep].any(), "masked positions must be zeros"
        # the pooler reads token 0: where it is a token, the pooled output agrees
        first = keep[:, 0]
        np.testing.assert_allclose(got["pooled"][first], want[1][first], rtol=1e-4, atol=1e-5)


def test_torch_key_padding_mask_marks_pads(tmp_path) -> None:
    """torch's key_padding_mask is True at a pad: the pass reads it that way round."""
    path, _ = export_mha(tmp_path, masked=True, dynamic=True)
    engine, report = _build(path, "cpu", packed=True)
    assert report.passes.get("remove_padding", 0) > 0, report.notes
    (index,) = [n for n in engine.graph.nodes if n.op == "PackIndex"]
    assert index.attrs["padding"] == 1
    _mha_agrees_where_kept(engine, path, 0.3)


def _mha_agrees_where_kept(engine, path, pad_rate: float, runs: int = 1) -> None:
    """The MultiheadAttention model's engine against onnxruntime on fresh [4, 7] inputs with
    token 0 real: equal wherever the mask keeps a token, zeros elsewhere."""
    rng = np.random.default_rng()
    ctx = engine.create_execution_context()
    for _ in range(runs):
        pad = rng.random((4, 7)) < pad_rate
        pad[:, 0] = False
        x = rng.standard_normal((4, 7, 32)).astype(np.float32)
        want = run_onnxruntime(path, {"x": x, "pad": pad})[0]
        got = ctx.infer({"x": x, "pad": pad})["y"]
        np.testing.assert_allclose(got[~pad], want[~pad], rtol=1e-4, atol=1e-4)
        assert not got[pad].any()


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_gpt2_causal_mask_packs(tmp_path, backend: str) -> None:
    """GPT-2's mask is causal and key-padding at once, and its GEMMs read the tokens flattened
    to [batch*sequence, width]: it packs, every attention causal, and agrees with onnxruntime
    wherever the mask keeps a token (left padding and holes too: a real token sees itself)."""
    model, feeds = build_gpt2()
    path = _export(model, feeds, tmp_path / "gpt2.onnx", ["hidden"])
    engine, report = _build(path, backend, packed=True)
    assert report.passes.get("remove_padding", 0) > 0, report.notes
    attentions = [n for n in engine.graph.nodes if n.op == "PackedAttention"]
    assert attentions and all(n.attrs["causal"] == 1 for n in attentions)
    rng = np.random.default_rng()
    ctx = engine.create_execution_context()
    right, holes = _masks(rng, 3, SEQ)
    for mask in (right, holes, right[:, ::-1].copy()):  # (the last: left padding)
        feeds = {"input_ids": rng.integers(0, 1000, mask.shape), "attention_mask": mask}
        want = run_onnxruntime(path, feeds)[0]
        got = ctx.infer(feeds)["hidden"]
        keep = mask != 0
        np.testing.assert_allclose(got[keep], want[keep], rtol=1e-4, atol=1e-4)
        assert not got[~keep].any()


def test_without_fused_attention_or_mask_nothing_changes(bert, tmp_path) -> None:
    engine, report = _build(bert, "reference", packed=True, level=0)
    assert any("no fused attention" in n for n in report.notes)
    assert "PackIndex" not in _ops(engine)
    path, _ = export_mha(tmp_path, masked=False, dynamic=True)
    engine, report = _build(path, "reference", packed=True)
    assert any("has no mask" in n for n in report.notes), report.notes
    # and off by default
    engine, report = _build(bert, "reference", packed=False)
    assert "PackIndex" not in _ops(engine) and not any("padding" in n for n in report.notes)


def test_cli_build_remove_padding(bert, tmp_path, capsys) -> None:
    from tensorkiln.cli.main import main

    out = tmp_path / "bert.engine"
    assert (
        main(["build", str(bert), "-o", str(out), "--backend", "reference", "--remove-padding"])
        == 0
    )
    assert "padding removed" in capsys.readouterr().out
    from tensorkiln.engine.engine import Engine

    engine = Engine.load(out)
    assert engine.build["config"]["remove_padding"] is True
    assert "PackedAttention" in _ops(engine)
    json.dumps(engine.build["config"])


# ---------------------------------------------------------------- kernels


def _oracle_attention(q, k, v, lengths, heads: int, causal: bool = False) -> np.ndarray:
    """softmax(q k^T / sqrt(d)) v per sequence and head (``causal``: row i sees keys up to i),
    in float64, written out."""
    out = np.zeros((q.shape[0], v.shape[1]))
    d, dv = q.shape[1] // heads, v.shape[1] // heads
    start = 0
    for n in lengths:
        for h in range(heads if n else 0):
            qs = q[start : start + n, h * d : (h + 1) * d].astype(np.float64)
            ks = k[start : start + n, h * d : (h + 1) * d].astype(np.float64)
            vs = v[start : start + n, h * dv : (h + 1) * dv].astype(np.float64)
            s = qs @ ks.T / np.sqrt(d)
            if causal:
                s = np.where(np.tri(n, dtype=bool), s, -np.inf)
            p = np.exp(s - s.max(axis=1, keepdims=True))
            out[start : start + n, h * dv : (h + 1) * dv] = (p / p.sum(axis=1, keepdims=True)) @ vs
        start += n
    return out


def test_pack_kernels_against_numpy() -> None:
    rng = np.random.default_rng()
    mask = (rng.random((4, 9)) < 0.6).astype(np.int64)
    mask[2] = 0
    keep = [(b, s) for b in range(4) for s in range(9) if mask[b, s]]
    x = rng.standard_normal((4, 9, 5)).astype(np.float32)
    want_rows = np.stack([x[b, s] for b, s in keep])
    want_ends = np.cumsum(mask.sum(axis=1))
    for padding, m in ((0, mask), (1, (mask == 0))):
        index, ends = ref_packing.pack_index(m, padding=padding)
        np.testing.assert_array_equal(ends, want_ends)
        np.testing.assert_array_equal(ref_packing.pack_tokens(x, index), want_rows)
        # torch: counted on the host, or given the count (as a CUDA graph's capture is)
        for hint in (None, len(keep)):
            with tokens_hint(hint):
                t_index, t_ends = cuda_packing.pack_index(torch.from_numpy(m), padding=padding)
            np.testing.assert_array_equal(t_index.numpy(), index)
            np.testing.assert_array_equal(t_ends.numpy(), want_ends)
    y = rng.standard_normal((len(keep), 5)).astype(np.float32)
    want = np.zeros_like(x)
    for row, (b, s) in zip(y, keep):
        want[b, s] = row
    np.testing.assert_array_equal(ref_packing.unpack_tokens(y, index, mask), want)
    got = cuda_packing.unpack_tokens(
        torch.from_numpy(y), torch.from_numpy(index), torch.from_numpy(mask)
    )
    np.testing.assert_array_equal(got.numpy(), want)


@pytest.mark.parametrize("causal", [0, 1], ids=["full", "causal"])
def test_packed_attention_kernels_against_numpy(causal: int) -> None:
    rng = np.random.default_rng()
    lengths = np.array([5, 0, 11, 1])
    ends = np.cumsum(lengths).astype(np.int32)
    heads, t = 2, int(lengths.sum())
    q, k, v = (rng.standard_normal((t, heads * 8)).astype(np.float32) for _ in range(3))
    mask = np.zeros((4, 12), np.int64)  # (only its shape is read: S bounds every length)
    want = _oracle_attention(q, k, v, lengths, heads, bool(causal))
    got = ref_packing.packed_attention(q, k, v, ends, mask, num_heads=heads, causal=causal)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    tq, tk, tv, te, tm = (torch.from_numpy(a) for a in (q, k, v, ends, mask))
    got = cuda_packing.packed_attention(tq, tk, tv, te, tm, num_heads=heads, causal=causal)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)


def test_packed_flash_kernel_through_the_interpreter(monkeypatch) -> None:
    from tensorkiln.kernels.triton import available, interpreting

    if not (available() and interpreting()):
        pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1)")
    from tensorkiln.kernels.triton import flash_attention as flash

    rng = np.random.default_rng()
    lengths = np.array([3, 70, 0, 129])
    ends = torch.from_numpy(np.cumsum(lengths).astype(np.int32))
    heads, d, t = 2, 16, int(lengths.sum())
    qkv = torch.from_numpy(rng.standard_normal((t, 3 * heads * d)).astype(np.float16))
    q, k, v = qkv.split(heads * d, dim=1)  # (strided views, as a Split of one GEMM gives them)
    assert flash.packed_applies(q, k, v, heads)
    for causal in (False, True):
        want = _oracle_attention(
            q.float().numpy(), k.float().numpy(), v.float().numpy(), lengths, heads, causal
        )
        for block_m in flash.BLOCKS_M:
            got = flash.packed_attention(
                q, k, v, ends, 129, heads=heads, scale=d**-0.5, block_m=block_m, causal=causal
            )
            np.testing.assert_allclose(got.float().numpy(), want, rtol=2e-2, atol=2e-3)


def test_a_rewrite_that_does_not_check_out_builds_without_it(bert, monkeypatch) -> None:
    """The pass rewrites a copy: when it fails its own shape check, the build goes on with the
    graph as it was, and the report says why."""
    import tensorkiln.builder.builder as builder_module
    from tensorkiln.errors import GraphError

    def broken(graph):
        graph.nodes = graph.nodes[: len(graph.nodes) // 2]  # (a half-done rewrite)
        raise GraphError("layer 'x' gives f32[?] on packed tokens")

    monkeypatch.setattr(builder_module, "remove_padding", broken)
    engine, report = _build(bert, "reference", packed=True)
    assert any(n.startswith("padding not removed: layer 'x'") for n in report.notes)
    assert "PackIndex" not in _ops(engine) and "Attention" in _ops(engine)
    rng = np.random.default_rng()
    feeds = {
        "input_ids": rng.integers(0, 1000, (2, SEQ)),
        "attention_mask": np.ones((2, SEQ), np.int64),
    }
    got = engine.create_execution_context().infer(feeds)["hidden"]
    np.testing.assert_allclose(got, run_onnxruntime(bert, feeds)[0], rtol=1e-4, atol=1e-4)


def test_packed_kernels_stay_in_bounds_on_hostile_wiring() -> None:
    """An engine file may feed these ops anything: out-of-range indices and lengths that do not
    add up are clamped (as the gathers clamp), never read or written past a tensor."""
    rng = np.random.default_rng()
    x = torch.from_numpy(rng.standard_normal((2, 3, 4)).astype(np.float32))
    index = torch.tensor([0, 5, 99, -7])
    packed = cuda_packing.pack_tokens(x, index)
    np.testing.assert_array_equal(packed.numpy(), x.reshape(6, 4).numpy()[[0, 5, 5, 0]])
    y = torch.from_numpy(rng.standard_normal((4, 4)).astype(np.float32))
    out = cuda_packing.unpack_tokens(y, index, torch.ones((2, 3), dtype=torch.int64))
    assert out.shape == (2, 3, 4) and torch.isfinite(out).all()
    q = torch.from_numpy(rng.standard_normal((5, 8)).astype(np.float32))
    for ends in ([9, 2], [3, 30], [-4, 5]):  # past the rows, decreasing, negative
        e = torch.tensor(ends, dtype=torch.int32)
        got = cuda_packing.packed_attention(q, q, q, e, torch.ones((2, 16)), num_heads=2)
        assert got.shape == (5, 8)
    from tensorkiln.kernels.triton import available, interpreting

    if available() and interpreting():
        from tensorkiln.kernels.triton import flash_attention as flash

        h = q.half()
        for ends in ([9, 2], [3, 30], [-4, 5]):
            e = torch.tensor(ends, dtype=torch.int32)
            got = flash.packed_attention(h, h, h, e, 16, heads=2, scale=0.25, block_m=64)
            assert got.shape == (5, 8)


class _Encoder(torch.nn.Module):
    """A Hugging Face encoder returning last_hidden_state."""

    def __init__(self, model) -> None:
        super().__init__()
        self.m = model

    def forward(self, input_ids, attention_mask):
        return self.m(input_ids=input_ids, attention_mask=attention_mask, return_dict=False)[0]


def _family(name: str):
    import transformers as t

    small = dict(
        vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=64,
    )  # fmt: skip
    if name == "distilbert":
        config = t.DistilBertConfig(
            vocab_size=1000, dim=64, n_layers=2, n_heads=4, hidden_dim=128,
            max_position_embeddings=64,
        )  # fmt: skip
        return t.DistilBertModel(config)
    if name == "roberta":  # (position ids computed from the token ids, a Shape of them read)
        return t.RobertaModel(t.RobertaConfig(**small, pad_token_id=1))
    return t.AlbertModel(t.AlbertConfig(**small, embedding_size=32))


@pytest.mark.parametrize("family", ["distilbert", "roberta", "albert"])
def test_other_encoder_families_pack(family: str, tmp_path) -> None:
    torch.manual_seed(0)
    model = _Encoder(_family(family).eval())
    rng = np.random.default_rng()
    mask = _masks(rng, 4, SEQ)[0]
    mask[0, 0] = 1  # (a first token everywhere: no sequence left empty here)
    feeds = {"input_ids": rng.integers(2, 1000, mask.shape), "attention_mask": mask}
    path = _export(model, feeds, tmp_path / f"{family}.onnx", ["hidden"])
    engine, report = _build(path, "cpu", packed=True)
    assert report.passes.get("remove_padding", 0) > 0, report.notes
    got = engine.create_execution_context().infer(feeds)["hidden"]
    want = run_onnxruntime(path, feeds)[0]
    keep = mask != 0
    scale = np.abs(want[keep]).max()
    np.testing.assert_allclose(got[keep], want[keep], rtol=1e-4, atol=1e-4 * scale)
    assert not got[~keep].any()


def test_a_bucketed_packed_length_gives_the_same_tokens() -> None:
    """CUDA graphs are captured per packed length rounded up (a few graphs for any stream of
    masks): the rows past the real count index a padding row that PackTokens clamps, attention
    never reads and UnpackTokens drops. Every kept token's value must be the exact count's."""
    from tensorkiln.kernels.common.packing import bucket

    capacity = 4 * 40
    lengths = {bucket(n, capacity) for n in range(capacity + 1)}
    assert len(lengths) <= 33 and all(bucket(n, capacity) >= n for n in range(capacity + 1))
    assert bucket(7168, 8192) == 7168 and bucket(43008, 49152) == 43008  # (the benchmarks')
    rng = np.random.default_rng()
    mask = torch.from_numpy((rng.random((4, 40)) < 0.6).astype(np.int64))
    count = int(mask.sum())
    rows = bucket(count, capacity)
    x = torch.from_numpy(rng.standard_normal((4, 40, 8)).astype(np.float32))
    exact_index, ends = cuda_packing.pack_index(mask)
    with tokens_hint(rows):
        index, ends_b = cuda_packing.pack_index(mask)
    assert index.shape[0] == rows >= count
    np.testing.assert_array_equal(index[:count].numpy(), exact_index.numpy())
    assert (index[count:] == capacity).all()
    np.testing.assert_array_equal(ends_b.numpy(), ends.numpy())
    packed = cuda_packing.pack_tokens(x, index)
    junk = torch.full((rows - count, 8), float("nan"))  # (whatever the padding rows become)
    y = torch.cat([packed[:count] * 2, junk])
    got = cuda_packing.unpack_tokens(y, index, mask)
    keep = mask.numpy() != 0
    np.testing.assert_array_equal(got.numpy()[keep], 2 * x.numpy()[keep])
    assert not got.numpy()[~keep].any()
    q = torch.from_numpy(rng.standard_normal((rows, 16)).astype(np.float32))
    q[count:] = float("nan")
    want = cuda_packing.packed_attention(q[:count], q[:count], q[:count], ends, mask, num_heads=2)
    got = cuda_packing.packed_attention(q, q, q, ends, mask, num_heads=2)
    np.testing.assert_allclose(got[:count].numpy(), want.numpy(), rtol=1e-6, atol=1e-6)


def test_from_pytorch_with_the_config() -> None:
    """tensorkiln.torch.compile takes the BuilderConfig: the dynamo exporter's masks (fused into
    Pointwise layers by then) are evaluated through those layers' bodies and qualify too."""
    pytest.importorskip("onnxscript")
    import tensorkiln.torch as tkt

    model, _ = build_bert()
    rng = np.random.default_rng()
    mask = _masks(rng, 3, SEQ)[0]
    mask[0, 0] = 1
    ids = torch.from_numpy(rng.integers(0, 1000, mask.shape))
    m = torch.from_numpy(mask)
    config = BuilderConfig()
    config.remove_padding = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = tkt.compile(model, (ids, m), config=config, backend="cpu")
    assert "PackedAttention" in _ops(compiled.engine), compiled.engine.build.get("notes")
    with torch.no_grad():
        want = model(ids, m)[0].numpy()
        got = compiled(ids, m)[0].numpy()
    keep = mask != 0
    np.testing.assert_allclose(got[keep], want[keep], rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert not got[~keep].any()


def test_packed_engines_run_the_plain_loop_and_profile_layers(bert) -> None:
    """A host mask's count reaches every way a context runs layers: the per-layer timings (a
    profile) come back, and the cpu backend's compiled path, traced per input shapes, is not
    taken (the packed shapes follow the mask's values) but said so."""
    engine, _ = _build(bert, "cpu", packed=True)
    rng = np.random.default_rng()
    mask = _masks(rng, 3, SEQ)[0]
    feeds = {"input_ids": rng.integers(0, 1000, mask.shape), "attention_mask": mask}
    want = run_onnxruntime(bert, feeds)[0]
    keep = mask != 0
    ctx = engine.create_execution_context()
    times: dict[str, float] = {}
    got = ctx.infer(feeds, layer_times=times)["hidden"]
    np.testing.assert_allclose(got[keep], want[keep], rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert any(name.endswith("_pack_index") for name in times), sorted(times)
    with pytest.warns(RuntimeWarning, match="removes padding"):
        compiled = engine.create_execution_context(compile=True)
    got = compiled.infer(feeds)["hidden"]
    np.testing.assert_allclose(got[keep], want[keep], rtol=1e-4, atol=1e-4 * np.abs(want).max())


class _CausalEncoder(torch.nn.Module):
    """Two pre-norm blocks of torch's MultiheadAttention with a causal attn_mask beside the
    key_padding_mask: every query sees the real keys up to itself."""

    def __init__(self) -> None:
        super().__init__()
        from tests.passes.test_fuse_mha import _Block

        self.blocks = torch.nn.ModuleList(_Block() for _ in range(2))

    def forward(self, x, pad):
        s = x.shape[1]
        future = torch.ones(s, s, dtype=torch.bool).triu(1)
        for block in self.blocks:
            y = block.ln_1(x)
            y, _ = block.attn(y, y, y, key_padding_mask=pad, attn_mask=future, need_weights=False)
            x = x + y
            x = x + block.mlp(block.ln_2(x))
        return x


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_causal_and_key_padding_mask_packs_causal(tmp_path, backend: str) -> None:
    """A mask that is causal and key-padding at once packs, each packed attention causal; the
    engine agrees with onnxruntime wherever the mask keeps a token."""
    torch.manual_seed(int(np.random.default_rng().integers(1 << 31)))
    model = _CausalEncoder().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    rng = np.random.default_rng()
    x = rng.standard_normal((3, 7, 32)).astype(np.float32)
    pad = np.zeros((3, 7), bool)
    path = _export(model, {"x": x, "pad": pad}, tmp_path / "causal.onnx", ["y"])
    engine, report = _build(path, backend, packed=True)
    assert report.passes.get("remove_padding", 0) > 0, report.notes
    attentions = [n for n in engine.graph.nodes if n.op == "PackedAttention"]
    assert attentions and all(n.attrs["causal"] == 1 for n in attentions)
    _mha_agrees_where_kept(engine, path, 0.35, runs=3)  # (token 0 real: no query sees nothing)


def test_flash_varlen_sequence_bounds_whatever_the_ends() -> None:
    """FlashAttention-2's cumulative lengths from any ``ends`` an engine file could hold: from
    0, never decreasing, no step over the mask's S, none past the rows there are; PackIndex's own
    ends come through unchanged. Within a run, kept with the tensor until it changes."""
    from tensorkiln.kernels.cuda.tactics_varlen import cu_seqlens
    from tensorkiln.kernels.derived import scope as derived_scope

    rng = np.random.default_rng()
    for _ in range(20):
        ends = torch.from_numpy(rng.integers(-50, 200, int(rng.integers(1, 9))).astype(np.int32))
        cu = cu_seqlens(ends, 100, 16).numpy()
        steps = np.diff(cu)
        assert cu[0] == 0 and cu.dtype == np.int32 and len(cu) == len(ends) + 1
        assert (steps >= 0).all() and (steps <= 16).all() and cu[-1] <= 100
    lengths = rng.integers(0, 17, 6)
    ends = torch.from_numpy(np.cumsum(lengths).astype(np.int32))
    with derived_scope():  # (one run of an engine: computed once for its attentions)
        cu = cu_seqlens(ends, int(lengths.sum()), 16)
        np.testing.assert_array_equal(cu.numpy(), np.concatenate([[0], np.cumsum(lengths)]))
        assert cu_seqlens(ends, int(lengths.sum()), 16) is cu
        ends.zero_()  # (written in place: computed again)
        assert not cu_seqlens(ends, int(lengths.sum()), 16).any()


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [0, 1], ids=["full", "causal"])
def test_flash_varlen_tactic_against_numpy(causal: int) -> None:
    from tensorkiln.kernels.cuda import tactics_varlen

    if not tactics_varlen.available():
        pytest.skip("needs a GPU that runs FlashAttention-2")
    rng = np.random.default_rng()
    lengths = np.array([5, 0, 70, 1, 128])
    heads, d, t = 2, 64, int(lengths.sum()) + 3  # (3 rows past the last sequence: padding)
    qkv = torch.from_numpy(rng.standard_normal((t, 3 * heads * d)).astype(np.float16)).cuda()
    q, k, v = qkv.split(heads * d, dim=1)  # (strided views, as a Split of one GEMM gives them)
    ends = torch.from_numpy(np.cumsum(lengths).astype(np.int32)).cuda()
    mask = torch.ones((5, 128), dtype=torch.int64, device="cuda")
    got = tactics_varlen.packed_attention_flash_varlen(
        q, k, v, ends, mask, num_heads=heads, causal=causal
    )
    n = int(lengths.sum())
    want = _oracle_attention(
        *(x[:n].float().cpu().numpy() for x in (q, k, v)), lengths, heads, bool(causal)
    )
    np.testing.assert_allclose(got[:n].float().cpu().numpy(), want, rtol=2e-2, atol=2e-3)


def test_a_batch_1_engine_packs(bert, tmp_path) -> None:
    """A profile of batch 1 makes the batch axis static: the mask probe's one row must still
    tell a token from a pad (a full row alone passes for either reading), and the engine agrees
    with onnxruntime wherever the mask keeps a token."""
    from tensorkiln.builder import OptimizationProfile

    config = BuilderConfig()
    config.remove_padding = True
    profile = OptimizationProfile()
    for name in ("input_ids", "attention_mask"):
        profile.set_shape(name, (1, SEQ), (1, SEQ), (1, SEQ))
    config.add_optimization_profile(profile)
    builder = Builder("cpu")
    engine = builder.build(bert, config, progress=False)
    assert builder.last_report.passes.get("remove_padding", 0) > 0, builder.last_report.notes
    ctx = engine.create_execution_context()
    rng = np.random.default_rng()
    for n in (SEQ, int(rng.integers(1, SEQ))):
        mask = np.zeros((1, SEQ), np.int64)
        mask[0, :n] = 1
        feeds = {"input_ids": rng.integers(0, 1000, mask.shape), "attention_mask": mask}
        want = run_onnxruntime(bert, feeds)[0]
        got = ctx.infer(feeds)["hidden"]
        keep = mask != 0
        scale = np.abs(want[keep]).max()
        np.testing.assert_allclose(got[keep], want[keep], rtol=1e-4, atol=1e-4 * scale)
