"""The ops the cuda backend runs on the host through their reference (numpy) kernels, each family
with the reason the device brings nothing.

These are written once, in kernels/reference: for inference they are rare (no benchmarked or
corpus model runs them in its hot path, and none in its shape arithmetic), their work is small or
host logic, or their values have no device representation. Their inputs are copied to the host
and their outputs back to the device (kernels/cuda/host.py), and ``tensorkiln ops --backend cuda``
lists each of them with its reason.
"""

from __future__ import annotations

from tensorkiln.kernels.cuda.host import register_host

ML = "ai.onnx.ml"
TRAINING = "ai.onnx.preview.training"

register_host(
    ["RegexFullMatch", "StringConcat", "StringNormalizer", "StringSplit"],
    "strings have no device representation (torch has no string tensors)",
)
register_host(
    "TfIdfVectorizer",
    "n-gram matching against a token pool is host logic over small token tensors, and its "
    "string inputs have no device representation",
)
register_host(
    ["LabelEncoder", "ArrayFeatureExtractor"],
    "classical ML over tabular rows: string keys, values and features have no device "
    "representation, and the numeric maps are small table lookups",
    domain=ML,
)
register_host(
    ["Binarizer", "Normalizer", "Scaler", "Imputer"],
    "classical ML transforms of small tabular rows, run beside the encoders and tree ensembles "
    "they feed",
    domain=ML,
)
register_host(
    ["TreeEnsemble", "TreeEnsembleClassifier", "TreeEnsembleRegressor"],
    "tree traversal of small tabular batches is branchy host logic, and class labels may be "
    "strings",
    domain=ML,
)
register_host(
    [
        "SequenceConstruct",
        "SequenceEmpty",
        "SequenceAt",
        "SequenceErase",
        "SequenceInsert",
        "SequenceLength",
        "SplitToSequence",
        "ConcatFromSequence",
    ],
    "a sequence is a host list of tensors; its bookkeeping is host logic (no model measured "
    "here uses sequences)",
)
register_host(
    ["Optional", "OptionalGetElement", "OptionalHasElement"],
    "wraps or unwraps a value without computing on it",
)
register_host(
    ["DFT", "STFT"],
    "spectral transforms appear in audio front ends run once per input (the Whisper encoder "
    "takes log-mel features), not in the measured models",
)
register_host(
    ["HannWindow", "HammingWindow", "BlackmanWindow", "MelWeightMatrix"],
    "constant tables made from a size (usually folded at build time)",
)
register_host(
    ["NegativeLogLikelihoodLoss", "SoftmaxCrossEntropyLoss"],
    "training losses: an inference engine does not compute them in its hot path",
)
register_host(
    ["Adagrad", "Adam", "Momentum"],
    "optimizer steps of the training domain: not inference",
    domain=TRAINING,
)
register_host(
    [
        "RandomUniform",
        "RandomUniformLike",
        "RandomNormal",
        "RandomNormalLike",
        "Bernoulli",
        "Multinomial",
    ],
    "random generators are sampling, not inference math (numpy's generator, one stream for "
    "both backends)",
)
