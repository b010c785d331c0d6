"""Reference kernels in numpy: the oracle for every other backend and the default on the CPU.

Importing this package registers every module below with the kernel registry.
"""

from importlib import import_module

_MODULES = (
    "elementwise",
    "cast",
    "math",
    "reduce",
    "quant",
    "loss",
    "tensor",
    "indexing",
    "image",
    "detection",
    "nn",
    "pool",
    "norm",
    "rnn",
    "signal",
    "attention",
    "sequence",
    "control",
    "text",
    "ml",
    "contrib",
    "training",
    "random",
    # fused ops of the tensorkiln domain, made by the graph optimizer
    "fused_conv",
    "fused_gemm",
    "fused_norm",
    "fused_attention",
    "fused_pointwise",
    "fused_se",
    "fused_quant",
    "packing",
)

for _name in _MODULES:
    import_module(f"{__name__}.{_name}")
