"""Backend-neutral kernel helpers: validation, geometry and attribute checks written once and used
by every kernel tree (reference, cuda, cpu, triton), and ops whose math is the same on every
backend written once over a small array adapter each tree supplies (rnn, control, attention,
deform, sampling, ...). Nothing here imports numpy-only or torch-only code paths; a module is
named after the kernel family it serves (conv, pool, rnn, ...)."""
