"""The cpu backend's own kernels, beside the torch kernels it shares with the cuda tree:
native C kernels compiled at first use (native.py, native.c) and the prepacked oneDNN
convolutions (conv.py). The cuda tree's kernels call them where their inputs are CPU tensors.
Importing this package registers nothing; it needs torch."""
