"""Model control: poll mode follows the repository folder (models added, changed, removed), and
the repository API loads and unloads only in explicit mode, as Triton's does."""

from __future__ import annotations

import asyncio
import shutil

import numpy as np
import pytest

from tensorkiln.serve.core import ServeError, ServerCore
from tests.serve.helpers import free_port, wait_until
from tests.serve.test_cli_serve import _cli, httpclient
from tests.serve.test_repository import _model


def test_poll_loads_added_reloads_changed_and_unloads_removed_models(tmp_path):
    _model(tmp_path, "digits", config="max_batch_size: 8")

    async def main():
        core = ServerCore(tmp_path, control_mode="poll")
        await core.load_all()
        try:
            assert core.ready("digits") and not core.ready("second")
            _model(tmp_path, "second", config="max_batch_size: 4")
            await core.poll()
            assert core.ready("second")
            before = core.model("digits")
            await core.poll()  # (nothing changed: nothing reloaded)
            assert core.model("digits") is before
            (tmp_path / "digits" / "config.pbtxt").write_text("max_batch_size: 12")
            await core.poll()
            assert core.model("digits") is not before
            assert core.model("digits").max_batch_size == 12
            x = np.random.default_rng().standard_normal((2, 1, 8, 8)).astype(np.float32)
            _, out = await core.infer("digits", None, {"input": x})
            assert out["logits"].shape == (2, 10)
            shutil.rmtree(tmp_path / "second")
            await core.poll()
            with pytest.raises(ServeError, match="unknown model 'second'"):
                core.model("second")
            # a broken model is recorded, and tried again once its files change
            _model(tmp_path, "broken", config="max_batch_size: -3")
            await core.poll()
            assert "broken" in core.failed and not core.ready("broken")
            (tmp_path / "broken" / "config.pbtxt").write_text("max_batch_size: 4")
            await core.poll()
            assert core.ready("broken") and "broken" not in core.failed
        finally:
            await core.close()

    asyncio.run(main())


@pytest.mark.parametrize("mode", ["none", "poll"])
def test_the_repository_api_loads_only_in_explicit_mode(tmp_path, mode):
    _model(tmp_path)

    async def main():
        core = ServerCore(tmp_path, control_mode=mode)
        await core.load_all()
        try:
            for call in (core.request_load, core.request_unload):
                with pytest.raises(ServeError, match=f"not allowed in model control mode '{mode}'"):
                    await call("digits")
            assert core.ready("digits")
        finally:
            await core.close()

    asyncio.run(main())


def test_serve_in_poll_mode_picks_up_a_model_added_while_running(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    port = free_port()
    proc = _cli("--model-repository", str(repo), "--http-port", str(port),
                "--http-address", "127.0.0.1", "--allow-grpc", "false", "--allow-metrics",
                "false", "--model-control-mode", "poll", "--repository-poll-secs", "1",
                "--engine-cache", str(tmp_path / "cache"))  # fmt: skip
    try:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
        wait_until(client.is_server_live, proc)
        assert not client.is_model_ready("digits")
        _model(repo)
        wait_until(lambda: client.is_model_ready("digits"), proc, seconds=60)
        x = np.random.default_rng().standard_normal((1, 1, 8, 8)).astype(np.float32)
        inp = httpclient.InferInput("input", [1, 1, 8, 8], "FP32")
        inp.set_data_from_numpy(x)
        assert client.infer("digits", [inp]).as_numpy("logits").shape == (1, 10)
        with pytest.raises(Exception, match="not allowed in model control mode 'poll'"):
            client.unload_model("digits")
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "Traceback" not in out, out
