"""The autotuner and the timing cache, on the cuda backend's torch kernels running on the CPU.

Test tactics stand in for the Triton ones (which the interpreter runs too slowly to time here):
a correct one, a correct but slow one, and a wrong one the oracle check must reject.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

torch = pytest.importorskip("torch")

from tensorkiln.builder import Builder, BuilderConfig  # noqa: E402
from tensorkiln.engine import Engine  # noqa: E402
from tensorkiln.errors import BuildError, EngineCompatibilityError  # noqa: E402
from tensorkiln.kernels import tactics as registry  # noqa: E402
from tensorkiln.kernels.registry import lookup  # noqa: E402
from tensorkiln.runtime import Runner  # noqa: E402
from tensorkiln.tactics import autotune  # noqa: E402
from tests.passes.util import model  # noqa: E402

F = TensorProto.FLOAT
RNG = np.random.default_rng(17)


def _mlp():
    rng = np.random.default_rng(3)  # the same weights on every call
    w1 = rng.standard_normal((32, 64)).astype(np.float32) * 0.2
    b1 = rng.standard_normal(64).astype(np.float32)
    w2 = rng.standard_normal((64, 16)).astype(np.float32) * 0.2
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"]),
        helper.make_node("Add", ["h", "b1"], ["hb"]),
        helper.make_node("Relu", ["hb"], ["r"]),
        helper.make_node("MatMul", ["r", "w2"], ["y"]),
    ]
    inits = [numpy_helper.from_array(a, n) for a, n in ((w1, "w1"), (b1, "b1"), (w2, "w2"))]
    return model(
        nodes,
        [helper.make_tensor_value_info("x", F, [8, 32])],
        [helper.make_tensor_value_info("y", F, [8, 16])],
        inits,
    )


def _default(op: str, domain: str):
    return lookup(op, domain, 1, "cuda").fn


@pytest.fixture
def test_tactics(monkeypatch):
    """Replace every registered tactic by three test tactics per GEMM-like op."""
    registry._load()  # the real kernel modules register theirs first, into the real table
    table: dict = {}
    monkeypatch.setattr(registry, "_TACTICS", table)
    for op, domain in (("GemmAct", "tensorkiln"), ("MatMul", "")):
        default = _default(op, domain)

        def same(*a, _f=default, **k):
            return _f(*a, **k)

        def slow(*a, _f=default, **k):
            time.sleep(0.02)
            return _f(*a, **k)

        def wrong(*a, _f=default, **k):
            return _f(*a, **k) + 1.0

        for name, fn in (("t_same", same), ("t_slow", slow), ("t_wrong", wrong)):
            registry.tactic(op, domain=domain, name=name)(fn)
    return table


def _build(tmp_path, cache=True, level=3, precision=None):
    cfg = BuilderConfig(optimization_level=level)
    if precision:
        cfg.set_flag(precision)
    if cache:
        cfg.timing_cache = str(tmp_path / "timing.cache")
    b = Builder("cuda", device="cpu")
    return b.build(_mlp(), cfg, progress=False), b.last_report


def test_autotuner_times_checks_and_records(test_tactics, tmp_path) -> None:
    engine, report = _build(tmp_path)
    tuned = [x for x in engine.layers if x.get("timings_ms")]
    assert tuned, engine.layers
    for layer in tuned:
        assert layer["candidates"] == ["default", "t_same", "t_slow", "t_wrong"]
        assert set(layer["timings_ms"]) == {"default", "t_same", "t_slow"}
        assert "relative error" in layer["rejected"]["t_wrong"]
        assert layer["tactic"] in ("default", "t_same")  # never the one 20 ms slower
        assert layer["timings_ms"]["t_slow"] >= 20.0
    assert report.timing_cache == {"hits": 0, "misses": len(tuned)}
    x = RNG.standard_normal((8, 32)).astype(np.float32)
    want = Runner(_mlp()).infer({"x": x})["y"]
    got = engine.create_execution_context().infer({"x": x})["y"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_timing_cache_makes_the_rebuild_measure_nothing(test_tactics, tmp_path) -> None:
    first, r1 = _build(tmp_path)
    second, r2 = _build(tmp_path)
    assert r1.timing_cache["misses"] > 0
    assert r2.timing_cache == {"hits": r1.timing_cache["misses"], "misses": 0}
    choices = [(x["name"], x["tactic"]) for x in first.layers]
    assert choices == [(x["name"], x["tactic"]) for x in second.layers]
    assert all(x.get("cached") for x in second.layers if x.get("timings_ms"))
    data = json.loads((tmp_path / "timing.cache").read_text())
    assert data["format"] == "tensorkiln-timing-cache" and len(data["entries"]) == len(
        [x for x in first.layers if x.get("timings_ms")]
    )


def test_a_rebuilt_tactic_is_timed_again(test_tactics, tmp_path) -> None:
    """A tactic's version (a kernel library's object-code digest) is part of the cache's key: a
    rebuild with the same versions measures nothing, one where a candidate's code changed under
    the same name times its layers again."""

    def versioned(version: str) -> None:
        for tactics in test_tactics.values():
            t = tactics["t_same"]
            tactics["t_same"] = registry.Tactic(
                t.name, t.op, t.domain, t.fn, t.supports, t.estimate, t.group, version
            )

    versioned("a" * 16)
    _, r1 = _build(tmp_path)
    _, r2 = _build(tmp_path)
    assert r1.timing_cache["misses"] > 0
    assert r2.timing_cache == {"hits": r1.timing_cache["misses"], "misses": 0}
    versioned("b" * 16)
    _, r3 = _build(tmp_path)
    assert r3.timing_cache == {"hits": 0, "misses": r1.timing_cache["misses"]}


def test_a_tactic_added_since_the_cache_was_written_is_timed(test_tactics, tmp_path) -> None:
    """A cache entry names the candidates it weighed: a build with a candidate the entry never
    saw (a new kernel) times the layer again, rather than keeping the old choice untimed; an
    entry from before entries named them counts the candidates it has timings of."""
    _, r1 = _build(tmp_path)
    tuned = r1.timing_cache["misses"]
    path = tmp_path / "timing.cache"
    data = json.loads(path.read_text())
    assert all("t_wrong" in e["candidates"] for e in data["entries"].values())
    for domain, op in list(test_tactics):
        default = _default(op, domain)
        registry.tactic(op, domain=domain, name="t_new")(lambda *a, _f=default, **k: _f(*a, **k))
    engine, r2 = _build(tmp_path)
    assert r2.timing_cache == {"hits": 0, "misses": tuned}
    assert all("t_new" in x["timings_ms"] for x in engine.layers if x.get("timings_ms"))
    _, r3 = _build(tmp_path)
    assert r3.timing_cache == {"hits": tuned, "misses": 0}
    # an older entry, no candidates named: t_wrong (rejected, so never timed) is not known
    data = json.loads(path.read_text())
    for entry in data["entries"].values():
        del entry["candidates"]
    path.write_text(json.dumps(data))
    _, r4 = _build(tmp_path)
    assert r4.timing_cache == {"hits": 0, "misses": tuned}
    _, r5 = _build(tmp_path)
    assert r5.timing_cache == {"hits": tuned, "misses": 0}


def _build_excluding(tmp_path, exclude: list[str]):
    cfg = BuilderConfig(timing_cache=str(tmp_path / "timing.cache"), tactic_exclude=exclude)
    b = Builder("cuda", device="cpu")
    return b.build(_mlp(), cfg, progress=False), b.last_report


def test_excluded_tactics_are_not_tried(test_tactics, tmp_path) -> None:
    """--tactic-exclude's names and patterns take tactics out of the candidates; a cache entry
    whose choice is excluded since is timed again, the others still answer."""
    engine, r1 = _build_excluding(tmp_path, ["t_s*"])
    tuned = [x for x in engine.layers if x.get("timings_ms")]
    assert tuned and r1.timing_cache == {"hits": 0, "misses": len(tuned)}
    for layer in tuned:
        assert layer["candidates"] == ["default", "t_wrong"]
        assert set(layer["timings_ms"]) == {"default"} and layer["tactic"] == "default"
    assert engine.build["config"]["tactic_exclude"] == ["t_s*"]
    # a full build, then every entry made to have chosen t_same (as a faster run would)
    _, r2 = _build_excluding(tmp_path, [])
    assert r2.timing_cache == {"hits": 0, "misses": len(tuned)}  # (more candidates than r1's)
    path = tmp_path / "timing.cache"
    data = json.loads(path.read_text())
    for entry in data["entries"].values():
        entry["tactic"] = entry["tactic_eager"] = "t_same"
    path.write_text(json.dumps(data))
    engine, r3 = _build_excluding(tmp_path, ["t_slow"])
    assert r3.timing_cache == {"hits": len(tuned), "misses": 0}
    assert all(x["tactic"] == "t_same" for x in engine.layers if x.get("timings_ms"))
    engine, r4 = _build_excluding(tmp_path, ["t_same"])
    assert r4.timing_cache == {"hits": 0, "misses": len(tuned)}
    assert all(x["tactic"] in ("default", "t_slow") for x in engine.layers if x.get("timings_ms"))


@pytest.mark.parametrize(
    ("field", "value"),
    [("tactic_exclude", "t_same"), ("tactic_exclude", [""]), ("tactic_timeout", 0),
     ("tactic_timeout", float("nan")), ("tactic_timeout", True)],
)  # fmt: skip
def test_bad_tactic_options_are_clear_errors(field, value) -> None:
    from tensorkiln.errors import InputError

    with pytest.raises(InputError, match=field):
        BuilderConfig(**{field: value}).validate()


_HANGING_BUILD = """
import sys, time
from tensorkiln.builder import Builder, BuilderConfig
from tensorkiln.kernels import tactics as registry
from tensorkiln.kernels.registry import lookup
from tests.tactics.test_autotune import _mlp

registry._load()
registry._TACTICS.clear()
fused = lookup("GemmAct", "tensorkiln", 1, "cuda").fn
registry.tactic("GemmAct", domain="tensorkiln", name="t_fine")(lambda *a, **k: fused(*a, **k))
def hang(*a, **k):
    time.sleep(120)  # (as a kernel that never ends keeps the synchronization waiting)
registry.tactic("MatMul", name="t_hang")(hang)
cfg = BuilderConfig(timing_cache=sys.argv[1], tactic_timeout=float(sys.argv[2]))
Builder("cuda", device="cpu").build(_mlp(), cfg, progress=False)
print("the build finished")
"""


def test_a_tactic_that_does_not_finish_stops_the_build_and_names_it(tmp_path) -> None:
    """With a tactic timeout, a candidate that never returns ends the process (status 3) with
    the layer and the tactic named and the way around it, and the layers tuned before it saved
    in the timing cache; a rebuild that excludes it then times only that layer."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    cache = tmp_path / "timing.cache"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root)])}
    t0 = time.perf_counter()
    run = subprocess.run(
        [sys.executable, "-c", _HANGING_BUILD, str(cache), "3"],
        capture_output=True, text=True, timeout=100, env=env, cwd=root,
    )  # fmt: skip
    assert run.returncode == autotune.STUCK_EXIT, run.stderr[-2000:]
    assert time.perf_counter() - t0 < 90  # (not the two minutes of the hanging tactic)
    assert "the build finished" not in run.stdout
    err = run.stderr
    assert "tactic 't_hang'" in err and "did not finish within 3 s" in err, err[-2000:]
    assert "(MatMul)" in err and "--tactic-exclude 't_hang'" in err
    assert str(cache) in err
    data = json.loads(cache.read_text())
    assert [e["candidates"] for e in data["entries"].values()] == [["default", "t_fine"]]


def test_damaged_timing_cache_is_a_clear_error(test_tactics, tmp_path) -> None:
    (tmp_path / "timing.cache").write_text("{not json")
    with pytest.raises(BuildError, match=r"timing cache .*timing\.cache"):
        _build(tmp_path)
    (tmp_path / "timing.cache").write_text(json.dumps({"format": "other"}))
    with pytest.raises(BuildError, match="not a tensorkiln timing cache"):
        _build(tmp_path)


def test_level_zero_skips_timing(test_tactics, tmp_path) -> None:
    engine, report = _build(tmp_path, level=0)
    assert all(x["tactic"] == "default" and "timings_ms" not in x for x in engine.layers)
    assert any(x.get("candidates") for x in engine.layers)
    assert report.timing_cache["misses"] == 0


def test_engine_keeps_its_tactics_through_a_file(test_tactics, tmp_path, monkeypatch) -> None:
    engine, _ = _build(tmp_path)
    # force a non-default choice so the loaded engine must find the tactic by name
    layer = next(x for x in engine.layers if x.get("timings_ms"))
    layer["tactic"] = layer["tactic_eager"] = "t_same"
    path = tmp_path / "m.engine"
    engine.save(path)
    loaded = Engine.load(path)
    assert [x.get("tactic") for x in loaded.layers] == [x.get("tactic") for x in engine.layers]
    x = RNG.standard_normal((8, 32)).astype(np.float32)
    got = loaded.create_execution_context().infer({"x": x})["y"]
    np.testing.assert_allclose(got, Runner(_mlp()).infer({"x": x})["y"], rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(registry, "_TACTICS", {})  # an installation without that tactic
    with pytest.raises(EngineCompatibilityError, match=r"t_same.*rebuild"):
        loaded.create_execution_context()


def test_a_missing_library_tactic_names_what_to_set(test_tactics, tmp_path) -> None:
    from tensorkiln.kernels.tactics import tactic_functions

    engine, _ = _build(tmp_path)
    layer = next(x for x in engine.layers if x.get("timings_ms"))
    node = next(n for n in engine.graph.nodes if n.name == layer["name"])
    node.op, node.domain = "QGemmAct", "tensorkiln"  # (the op the CUTLASS family serves)
    layer["tactic"] = "cutlass_fp8_gemm_fp8_fp8_channel_relu_128x128o2k4"
    with pytest.raises(EngineCompatibilityError, match=r"TENSORKILN_CUTLASS_KERNELS.*rebuild"):
        tactic_functions(engine.graph, engine.layers, "graph")
    layer["tactic"] = "t_gone"
    with pytest.raises(EngineCompatibilityError, match=r"is triton installed\?"):
        tactic_functions(engine.graph, engine.layers, "graph")


def test_graph_and_eager_choices_are_kept_apart(test_tactics, tmp_path) -> None:
    from tensorkiln.kernels.tactics import tactic_functions

    engine, _ = _build(tmp_path)
    tuned = [x for x in engine.layers if x.get("timings_ms")]
    for layer in tuned:
        assert set(layer["timings_eager_ms"]) == set(layer["timings_ms"])
        assert layer["tactic_eager"] in ("default", "t_same")
        layer["tactic"], layer["tactic_eager"] = "t_same", "default"
    graph_mode = tactic_functions(engine.graph, engine.layers, "graph")
    assert set(graph_mode) == {x["name"] for x in tuned}
    assert tactic_functions(engine.graph, engine.layers, "eager") == {}


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_reduced_precision_engine(test_tactics, tmp_path, precision) -> None:
    engine, _ = _build(tmp_path, cache=False, precision=precision)
    assert engine.build["precision"] == precision
    assert engine.inputs[0].dtype == "FLOAT" and engine.outputs[0].dtype == "FLOAT"
    x = RNG.standard_normal((8, 32)).astype(np.float32)
    want = Runner(_mlp()).infer({"x": x})["y"]
    got = engine.create_execution_context().infer({"x": x})["y"]
    assert got.dtype == np.float32
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-2


def test_torch_inputs_come_back_as_tensors(test_tactics, tmp_path) -> None:
    engine, _ = _build(tmp_path, cache=False)
    x = torch.randn(8, 32)
    want = Runner(_mlp()).infer({"x": x.numpy()})["y"]
    with engine.create_execution_context() as ctx:
        out = ctx.infer({"x": x})
        assert isinstance(out["y"], torch.Tensor)
        np.testing.assert_allclose(out["y"].numpy(), want, rtol=1e-5, atol=1e-5)
        buf = torch.full((8, 16), float("nan"))
        ctx.infer({"x": x}, outputs={"y": buf})
        np.testing.assert_allclose(buf.numpy(), want, rtol=1e-5, atol=1e-5)

        class Producer:  # any DLPack producer
            def __init__(self, t):
                self.t = t

            def __dlpack__(self, **kw):
                return self.t.__dlpack__(**kw)

            def __dlpack_device__(self):
                return self.t.__dlpack_device__()

        out = ctx.infer({"x": Producer(x)})
        np.testing.assert_allclose(out["y"].numpy(), want, rtol=1e-5, atol=1e-5)


def test_wrong_tensor_inputs_are_clear_errors(test_tactics, tmp_path) -> None:
    from tensorkiln.errors import InputError

    engine, _ = _build(tmp_path, cache=False)
    ctx = engine.create_execution_context()
    with pytest.raises(InputError, match="'x' expects dtype float32"):
        ctx.infer({"x": torch.randn(8, 32, dtype=torch.float64)})
    with pytest.raises(InputError, match="'x'"):
        ctx.infer({"x": torch.randn(8, 31)})
    with pytest.raises(InputError, match="output buffer 'y' is"):
        ctx.infer({"x": torch.randn(8, 32)}, outputs={"y": torch.empty(8, 15)})


def test_inspect_shows_tactics_and_runners_up(test_tactics, tmp_path, capsys) -> None:
    from tensorkiln.cli.main import main

    engine, _ = _build(tmp_path)
    layer = next(x for x in engine.layers if x.get("timings_ms"))
    layer["tactic"], layer["tactic_eager"] = "t_same", "default"
    engine.save(tmp_path / "m.engine")
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "m.engine")]) == 0
    out = capsys.readouterr().out
    assert "tactic (ms, as a CUDA graph)" in out and "runners-up (ms)" in out
    assert f"t_same {layer['timings_ms']['t_same']:.4f} (layer by layer: default" in out
    assert "1 rejected" in out  # t_wrong


def test_pruning_keeps_the_best_estimated_candidates() -> None:
    from tensorkiln.kernels.tactics import LayerSpec, Tactic
    from tensorkiln.tactics.autotune import _prune

    spec = LayerSpec("MatMul", "", {}, ((8, 32), (32, 16)), ("float32", "float32"))
    scores = {"t_a": 0.1, "lib_x": 0.0, "t_b": 0.9, "t_c": 0.5, "t_d": 0.7, "t_e": 0.2}
    tactics = [Tactic(n, "MatMul", "", len, None, lambda s, v=v: v) for n, v in scores.items()]
    kept, pruned = _prune(tactics, spec, 3)
    # the three best of source "t" in registration order; "lib" has its own budget
    assert [t.name for t in kept] == ["lib_x", "t_b", "t_c", "t_d"]
    assert pruned == ["t_a", "t_e"]
    assert _prune(tactics, spec, None) == (tactics, [])
    assert _prune(tactics[:2], spec, 3) == (tactics[:2], [])


def test_triton_gemm_estimates_favour_tiles_that_fill_the_gpu() -> None:
    pytest.importorskip("triton")
    from tensorkiln.kernels.tactics import LayerSpec, tactics_for
    from tensorkiln.tactics.autotune import _prune

    def kept(m, k, n):
        spec = LayerSpec(
            "GemmAct", "tensorkiln", {"activation": "Relu"}, ((m, k), (k, n), (n,)),
            ("float16",) * 3, "cuda", (False, True, True),
        )  # fmt: skip
        applicable = [t for t in tactics_for("GemmAct", "tensorkiln") if t.applies(spec)]
        return {t.name for t in _prune(applicable, spec, 4)[0]}

    small = kept(128, 768, 768)  # 128 x 768 outputs: large tiles leave most SMs idle
    assert "triton_gemm_128x256x64_w8_s3" not in small and "triton_gemm_64x64x64_w4_s4" in small
    large = kept(8192, 768, 3072)  # many waves of large tiles
    assert "triton_gemm_128x256x64_w8_s3" in large


def test_a_narrower_search_does_not_answer_a_wider_one(test_tactics, tmp_path) -> None:
    cfg = BuilderConfig(tactic_sources={"triton"}, timing_cache=str(tmp_path / "tc"))
    # the test tactics' names start with "t", not "triton": nothing competes with the default
    b = Builder("cuda", device="cpu")
    b.build(_mlp(), cfg, progress=False)
    assert b.last_report.timing_cache == {"hits": 0, "misses": 0}
    cfg_all = BuilderConfig(timing_cache=str(tmp_path / "tc"))
    b.build(_mlp(), cfg_all, progress=False)
    assert b.last_report.timing_cache["misses"] > 0  # measured, not answered by the narrow run
    cfg_lvl5 = BuilderConfig(optimization_level=5, timing_cache=str(tmp_path / "tc"))
    b.build(_mlp(), cfg_lvl5, progress=False)
    assert b.last_report.timing_cache["hits"] == 0  # a wider search than level 3's


@pytest.mark.parametrize(("max_batch", "offered"), [(8, True), (32, False)])
def test_a_tactic_must_apply_over_the_whole_profile(monkeypatch, max_batch, offered) -> None:
    """Tactics are timed at the opt shapes, but the engine runs anywhere in [min, max]: one
    whose constraints fail at the profile's max batch is not a candidate."""
    from tensorkiln.builder import OptimizationProfile

    registry._load()
    monkeypatch.setattr(registry, "_TACTICS", {})
    default = _default("MatMul", "")
    registry.tactic("MatMul", name="t_upto8", supports=lambda spec: spec.shapes[0][0] <= 8)(
        lambda *a, **k: default(*a, **k)
    )
    m = _mlp()
    for value in (*m.graph.input, *m.graph.output):
        value.type.tensor_type.shape.dim[0].dim_param = "N"
    cfg = BuilderConfig()
    cfg.add_optimization_profile(
        OptimizationProfile().set_shape("x", (1, 32), (4, 32), (max_batch, 32))
    )
    engine = Builder("cuda", device="cpu").build(m, cfg, progress=False)
    matmuls = [x for x in engine.layers if x["op"] == "MatMul"]
    assert matmuls
    for layer in matmuls:
        assert ("t_upto8" in layer.get("candidates", [])) is offered
    x = RNG.standard_normal((max_batch, 32)).astype(np.float32)
    want = Runner(_mlp()).infer({"x": x[:8]})["y"]
    got = engine.create_execution_context().infer({"x": x[:8]})["y"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_eight_bit_outputs_are_checked_to_one_step_of_their_grid() -> None:
    """A layer that writes the next one's int8 or E4M3 input (fuse_requantize) is checked, not
    skipped as integer outputs are: an int8 value one step off on a rounding edge passes, two
    steps off or many values off fail; E4M3 values are held to the tensor's scale."""
    torch = pytest.importorskip("torch")
    from tensorkiln.tactics.autotune import _rel_error

    rng = np.random.default_rng()
    want = torch.from_numpy(rng.integers(-120, 121, 4000).astype(np.int8))
    edge = want.clone()
    edge[:20] += 1  # (0.5% one step off)
    assert _rel_error([edge], [want]) == 0.0
    far = want.clone()
    far[7] += 2
    assert _rel_error([far], [want]) == float("inf")
    noisy = want.clone()
    noisy[::2] += 1  # (half of them: more than the rounding itself adds)
    assert _rel_error([noisy], [want]) == float("inf")
    e4m3 = torch.from_numpy(rng.standard_normal(4000).astype(np.float32) * 50)
    w8 = e4m3.to(torch.float8_e4m3fn)
    codes = w8.view(torch.uint8).clone()
    below_max = (codes & 0x7F) < 0x7E
    codes[:30] += below_max[:30].to(torch.uint8)  # (the next E4M3 value away from zero)
    mixed = codes.view(torch.float8_e4m3fn)
    assert not torch.equal(mixed.float(), w8.float())
    assert _rel_error([mixed], [w8]) == 0.0
    assert _rel_error([(w8.float() * 1.3).to(torch.float8_e4m3fn)], [w8]) == float("inf")
    # float32 sums (coarser still on FP8 tensor cores) miss a value near zero by several of its
    # own fine steps while staying tiny beside the tensor's largest: accepted, as a float
    # output's small error relative to its norm is
    near_zero = e4m3.clone()
    near_zero[:40] = torch.from_numpy(rng.uniform(-0.1, 0.1, 40).astype(np.float32))
    w_small = near_zero.to(torch.float8_e4m3fn)
    shifted = near_zero.clone()
    shifted[:40] += 0.3  # (a hundredth of the top values' step)
    g_small = shifted.to(torch.float8_e4m3fn)
    assert (g_small.float() != w_small.float())[:40].sum() > 30
    assert _rel_error([g_small], [w_small]) == 0.0
    top = w8.float().abs().argmax()
    beyond = w8.float().clone()
    beyond[top] += 2.2 * 2.0 ** (np.floor(np.log2(beyond[top].abs().item())) - 3)
    assert _rel_error([beyond.to(torch.float8_e4m3fn)], [w8]) == float("inf")


def test_a_rejection_without_a_finite_error_says_what_differs() -> None:
    """A candidate refused with an infinite error names what made it so: another type or shape,
    NaN where the oracle has numbers, 8-bit values off the oracle's grid."""
    torch = pytest.importorskip("torch")
    from tensorkiln.tactics.autotune import _mismatch

    rng = np.random.default_rng()
    want = torch.from_numpy(rng.standard_normal((6, 5)).astype(np.float32))
    assert "float16" in _mismatch([want.half()], [want])
    nan = want.clone()
    nan[2, 3] = float("nan")
    assert "NaN in 1 of 30" in _mismatch([nan], [want])
    codes = torch.from_numpy(rng.integers(-100, 100, 40).astype(np.int8))
    off = codes.clone()
    off[5] += 3
    assert "up to 3" in _mismatch([off], [codes])


def test_a_tactic_family_names_candidates_per_layer(monkeypatch, tmp_path) -> None:
    """A family's candidates are named from the layer (here its row count), timed and checked
    like any tactic, each in a group of its own; an engine's recorded name resolves through the
    family at load, and an installation without the family refuses the engine."""
    registry._load()
    monkeypatch.setattr(registry, "_TACTICS", {})
    monkeypatch.setattr(registry, "_FAMILIES", {})
    default = _default("GemmAct", "tensorkiln")

    def wrong(*a, **k):
        return default(*a, **k) + 1.0

    def resolve(name: str):
        kind, _, rows = name.removeprefix("fam_").partition("_")
        if kind not in ("same", "wrong") or not rows.isdigit():
            return None
        fn = default if kind == "same" else wrong
        return registry.Tactic(name, "GemmAct", "tensorkiln", fn, None, None, name)

    def expand(spec):
        rows = spec.shapes[0][0]
        return [f"fam_same_{rows}", f"fam_wrong_{rows}"]

    family = registry.TacticFamily("fam_", expand, resolve)
    registry.tactic_family("GemmAct", family, domain="tensorkiln")
    engine, _ = _build(tmp_path)
    tuned = [x for x in engine.layers if x.get("timings_ms")]
    assert tuned
    for layer in tuned:
        assert layer["candidates"] == ["default", "fam_same_8", "fam_wrong_8"]
        assert "relative error" in layer["rejected"]["fam_wrong_8"]
        layer["tactic"] = layer["tactic_eager"] = "fam_same_8"
    path = tmp_path / "m.engine"
    engine.save(path)
    loaded = Engine.load(path)
    x = RNG.standard_normal((8, 32)).astype(np.float32)
    got = loaded.create_execution_context().infer({"x": x})["y"]
    np.testing.assert_allclose(got, Runner(_mlp()).infer({"x": x})["y"], rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(registry, "_FAMILIES", {})
    with pytest.raises(EngineCompatibilityError, match=r"fam_same_8.*rebuild"):
        loaded.create_execution_context()


def test_a_timed_tactic_derives_shared_values_once_for_all_its_calls() -> None:
    """The autotuner times a layer's calls inside one scope of derived values
    (kernels/derived.py), as an engine's run shares them across its layers: a kernel's
    derivation from a shared input (FlashAttention-2's cumulative lengths, the flash kernel's
    mask row ends) is made once for the calls, not charged to each; the scope ends with the
    layer's timing."""
    from tensorkiln.backends import get_backend
    from tensorkiln.kernels import derived
    from tensorkiln.kernels.registry import KernelEntry
    from tensorkiln.tactics import autotune

    rng = np.random.default_rng()
    mask, x = rng.random(8), rng.random(8)
    made = []

    def kernel(x):
        for _ in range(3):  # (as three layers, or three timed calls, of one run)
            ends = derived.derived(mask, ("ends",), lambda: made.append(1) or np.cumsum(mask))
        return x + ends

    entry = KernelEntry("Add", "", 1, "test", kernel, False, False)
    autotune._time(entry, [x], {}, 1, None, get_backend("reference"), autotune.TuneOptions())
    assert made == [1]
    assert getattr(derived._local, "cache", None) is None
    kernel(x)  # (outside a timing: computed at every call, as before)
    assert made == [1, 1, 1, 1]


def test_a_layer_without_concrete_shapes_says_why_it_was_not_timed(
    test_tactics, tmp_path, monkeypatch
) -> None:
    """Where shape inference leaves a layer's input symbolic at the profile's shapes, the
    autotuner has nothing to time it at: the layer keeps its default kernel and its record
    (and the build report) says why, rather than that no tactic takes it."""
    from tensorkiln.ir import TensorType

    real = autotune._concrete_types

    def symbolic_h(graph, shapes):  # (as an op ONNX cannot infer leaves its output)
        types = real(graph, shapes)
        return {k: (TensorType(t.dtype, ("n", *t.shape[1:])) if k == "r" else t)
                for k, t in types.items()}  # fmt: skip

    monkeypatch.setattr(autotune, "_concrete_types", symbolic_h)
    engine, report = _build(tmp_path, cache=False)
    by_input = {layer["inputs"][0]: layer for layer in engine.layers if layer.get("inputs")}
    second = by_input["r"]
    assert second["tactic"] == "default" and "not concrete" in second["fallback"]
    assert any(x.get("timings_ms") for x in engine.layers)  # (the first layer is still timed)
    assert "not concrete" in report.summary()
