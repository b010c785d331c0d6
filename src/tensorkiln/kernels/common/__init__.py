"""Backend-neutral kernel helpers: validation, geometry and attribute checks written once and used
by every kernel tree (reference, cuda, cpu, triton). Nothing here imports numpy-only or torch-only
code paths; a module is named after the kernel family it serves (conv, pool, rnn, ...)."""
