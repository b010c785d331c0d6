"""Operators of the ``com.microsoft`` domain (onnxruntime's contrib ops) on the device.

DynamicQuantizeLSTM is kernels/common/rnn.py's, over the device's recurrent layers: the int8/uint8
weights are dequantized on the device and the LSTM runs with the hidden state rounded to the
activation grid at every step, as onnxruntime does.
"""

from __future__ import annotations

from tensorkiln.kernels.common.rnn import MS
from tensorkiln.kernels.cuda.rnn import LAYERS
from tensorkiln.kernels.registry import register

register("DynamicQuantizeLSTM", domain=MS, since=1, backend="cuda")(LAYERS.dynamic_quantize_lstm)
