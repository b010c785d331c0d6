"""Running graphs: the executor, input binding and runners."""

from tensorkiln.runtime.executor import Executor, Scope, check_supported
from tensorkiln.runtime.runner import Runner, run_onnx

__all__ = ["Executor", "Runner", "Scope", "check_supported", "run_onnx"]
