"""The deployment examples in docs/deploy name only flags and endpoints tensorkiln serve has:
their arguments parse with the command's own parser, their probes hit endpoints the server
answers, their ports match."""

from __future__ import annotations

from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

from tensorkiln.cli.main import _parser  # noqa: E402

DEPLOY = Path(__file__).resolve().parents[2] / "docs" / "deploy"


def _containers(path: Path) -> list[dict]:
    out = []
    for doc in yaml.safe_load_all(path.read_text()):
        spec = doc.get("spec", {})
        pod = spec.get("template", {}).get("spec", {}) or spec.get("predictor", {})
        out += pod.get("containers", [])
    return out


@pytest.mark.parametrize("name", ["kubernetes.yaml", "kserve-inferenceservice.yaml"])
def test_manifests_use_real_flags_and_endpoints(name):
    containers = _containers(DEPLOY / name)
    assert containers
    for c in containers:
        args = list(c.get("args", []))
        if c.get("command"):
            assert c["command"][:2] == ["tensorkiln", "serve"]
        else:  # (the image's entrypoint adds --model-repository /models)
            args = ["--model-repository", "/models", *args]
        parsed = _parser().parse_args(["serve", *args])  # (an unknown flag exits here)
        ports = {p["containerPort"] for p in c["ports"]}
        assert parsed.http_port in ports
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            if probe in c:
                assert c[probe]["httpGet"]["path"] in ("/v2/health/ready", "/v2/health/live")


def test_the_dockerfile_serves_the_mounted_repository():
    text = (DEPLOY / "Dockerfile").read_text()
    assert "tensorkiln serve --model-repository /models" in text
    assert "EXPOSE 8000 8001 8002" in text and "USER serve" in text
