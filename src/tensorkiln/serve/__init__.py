"""``tensorkiln serve``: engines behind the KServe v2 protocol that Triton Inference Server speaks,
so that its clients (tritonclient), dashboards and orchestration work unchanged.

Built so far: the model repository in Triton's layout (:mod:`tensorkiln.serve.repository`) and the
protocol's messages (:mod:`tensorkiln.serve.protocol`).
"""

from tensorkiln.serve.repository import ModelEntry, ModelRepository, ModelVersion

__all__ = ["ModelEntry", "ModelRepository", "ModelVersion"]
