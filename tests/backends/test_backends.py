"""The Backend seam: what each backend is, moves and holds, checked against numpy and torch."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from tensorkiln import backends
from tensorkiln.backends import Backend, check_target, get_backend
from tensorkiln.errors import EngineCompatibilityError, InputError, TensorkilnError

torch = pytest.importorskip("torch")


def test_each_backend_names_its_kernels_and_capabilities() -> None:
    ref, cpu = get_backend("reference"), get_backend("cpu")
    cuda_here = get_backend("cuda", "cpu")  # the cuda kernels on CPU tensors, as tests run them
    assert (ref.name, ref.kernels, ref.device, ref.on_device) == (
        "reference",
        "reference",
        None,
        False,
    )
    assert (cpu.name, cpu.kernels, cpu.device) == ("cpu", "cuda", torch.device("cpu"))
    assert (cuda_here.name, cuda_here.kernels) == ("cuda", "cuda")
    assert cpu.holds_weights and cpu.specializes and cpu.thread_tuning and cpu.compiles
    assert not (cpu.host_mirror or cpu.math_modes or cpu.autotunes or cpu.streams)
    assert cuda_here.host_mirror and cuda_here.math_modes and cuda_here.autotunes
    assert not (cuda_here.streams or cuda_here.cuda_graphs)  # no GPU behind CPU tensors
    plain = cpu.plain()
    assert not (plain.holds_weights or plain.specializes) and plain.name == "cpu"
    assert get_backend(cpu) is cpu  # a Backend passes through


@pytest.mark.parametrize("name", ["reference", "cpu"])
def test_values_go_to_the_device_and_come_back_unchanged(name: str) -> None:
    backend = get_backend(name)
    rng = np.random.default_rng()
    arrays = [
        rng.standard_normal((3, 4)).astype(np.float32),
        rng.integers(-50, 50, (2, 5)).astype(np.int64),
        rng.standard_normal(6).astype(ml_dtypes.bfloat16),
        np.array(rng.standard_normal(), np.float64),  # 0-d stays 0-d
        np.array(["a", "bc"], dtype=object),  # strings stay on the host
    ]
    for arr in arrays:
        on = backend.to_device(arr)
        if backend.on_device and arr.dtype != object:
            assert isinstance(on, torch.Tensor) and on.device == backend.device
        back = backend.to_host(on)
        assert back.dtype == arr.dtype and back.shape == arr.shape
        np.testing.assert_array_equal(back, arr)
    listed = backend.to_host(backend.to_device([arrays[0], arrays[1]]))  # sequences
    for got, want in zip(listed, arrays[:2]):
        np.testing.assert_array_equal(got, want)


def test_the_cpu_backend_holds_convolution_weights_and_mirrors_small_constants() -> None:
    cpu = get_backend("cpu")
    rng = np.random.default_rng()
    w = rng.standard_normal((8, 4, 3, 3)).astype(np.float32)
    held = cpu.constant(w, conv_weight=True)
    assert held.is_contiguous(memory_format=torch.channels_last)  # as its convolutions run it
    np.testing.assert_array_equal(held.numpy(), w)
    shape = np.array([2, 3, 4], np.int64)
    c = cpu.constant(shape)
    np.testing.assert_array_equal(cpu.known_on_host(c), shape)  # no device read to learn it
    plain = cpu.plain().constant(w, conv_weight=True)
    assert plain.is_contiguous()  # the plain route takes weights as they are


def test_the_host_mirror_takes_small_unknown_values_only() -> None:
    cuda_here = get_backend("cuda", "cpu")
    small = torch.arange(4)
    assert cuda_here.mirrorable(small)
    cuda_here.remember_on_host(small, np.arange(4))
    assert not cuda_here.mirrorable(small)  # known already
    assert not cuda_here.mirrorable(torch.zeros(1000))  # too big to be a shape
    assert not get_backend("reference").mirrorable(np.arange(4))


def test_a_backend_that_cannot_run_here_is_a_clear_error(monkeypatch) -> None:
    with pytest.raises(TensorkilnError, match="reference backend runs on the CPU"):
        get_backend("reference", "cuda")
    with pytest.raises(TensorkilnError, match="unknown backend 'tpu'"):
        get_backend("tpu")
    with pytest.raises(TensorkilnError, match="cpu backend runs on the CPU"):
        get_backend("cpu", "cuda:0")
    with pytest.raises(InputError, match="unknown device 'xpu'"):
        backends.resolve("cuda", "xpu")
    if not torch.cuda.is_available():
        with pytest.raises(TensorkilnError, match="needs a CUDA device"):
            get_backend("cuda")
    monkeypatch.setitem(__import__("sys").modules, "torch", None)  # as on a machine without it
    with pytest.raises(TensorkilnError, match="needs PyTorch"):
        get_backend("cpu")
    assert backends.auto_backend() == "reference"
    assert isinstance(get_backend("reference"), Backend)


def test_targets_are_checked_against_this_machine() -> None:
    cpu = get_backend("cpu")
    target = cpu.target()
    assert target["device"] == "cpu" and target["torch"] == torch.__version__
    check_target("cpu", target, "'m.engine'", "Rebuild it.")  # runs here: no error
    check_target("reference", {}, "'m.engine'", "Rebuild it.")
    if torch.cuda.is_available():
        pytest.skip("the mismatch below needs a machine without a GPU")
    gpu = {"device": "NVIDIA H200", "compute_capability": "9.0"}
    with pytest.raises(EngineCompatibilityError, match=r"built for the GPU .*H200.*Rebuild it\."):
        check_target("cuda", gpu, "'m.engine'", "Rebuild it.")


def test_memory_limits_are_the_machines_on_the_cpu() -> None:
    limit, what = get_backend("cpu").memory_limit()
    assert limit is None or limit > 2**20
    assert get_backend("reference").memory_limit() == (limit, what)
    assert get_backend("cpu").allocated() == 0


def test_a_pool_given_back_during_a_capture_waits_for_the_next_acquire(monkeypatch) -> None:
    """A context collected while this thread captures a CUDA graph gives its pool back then:
    waiting on its stream would break the capture, so the pair waits, and the next acquire
    outside a capture waits on the stream and hands the pool out."""
    pytest.importorskip("torch")
    from tensorkiln.backends import pools

    class Stream:
        waited = 0

        def synchronize(self) -> None:
            self.waited += 1

    capturing = [True]
    monkeypatch.setattr(pools, "_capturing", lambda: capturing[0])
    monkeypatch.setattr(pools, "_free", {})
    monkeypatch.setattr(pools, "_pending", [])
    pool, stream = object(), Stream()
    pools.release(pool, stream, "cuda:0", kind="test")
    assert stream.waited == 0 and pools._free == {}
    pools._settle()  # (still capturing: nothing waits)
    assert stream.waited == 0 and len(pools._pending) == 1
    capturing[0] = False
    assert pools.acquire("cuda:0", kind="test") == (pool, stream)
    assert stream.waited == 1 and pools._pending == [] and pools._free == {("test", 0): []}
    pools.release(pool, stream, "cuda:0", kind="test")  # (outside a capture: waits at once)
    assert stream.waited == 2 and pools._free == {("test", 0): [(pool, stream)]}
