"""``tensorkiln serve``: engines behind the KServe v2 protocol that Triton Inference Server speaks,
so that its clients (tritonclient), dashboards and orchestration work unchanged.

The model repository in Triton's layout (repository.py), the protocol's messages (protocol.py), a
served model version (model.py), dynamic batching (batcher.py), the protocol-free server state
(core.py), and the HTTP (http.py) and gRPC (grpc.py) front ends.
"""

from tensorkiln.serve.repository import ModelEntry, ModelRepository, ModelVersion

__all__ = ["ModelEntry", "ModelRepository", "ModelVersion"]
