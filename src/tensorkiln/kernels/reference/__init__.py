"""Reference kernels in numpy: the oracle for every other backend and the default on the CPU.

Importing this package registers every module below with the kernel registry.
"""

from importlib import import_module

_MODULES = (
    "elementwise",
    "math",
    "tensor",
    "nn",
    "reduce",
    "quant",
    "rnn",
    "signal",
    "sequence",
    "control",
    "text",
    "ml",
    "training",
    "attention",
)

for _name in _MODULES:
    try:
        import_module(f"{__name__}.{_name}")
    except ModuleNotFoundError as exc:  # a module not written yet
        if exc.name != f"{__name__}.{_name}":
            raise
