"""String operators and TfIdfVectorizer on the cuda backend: all run on the host.

torch has no string tensors, so string values never leave the host and these ops run their
reference kernels there (RegexFullMatch through RE2, as on the reference backend); TfIdfVectorizer counts n-grams of a token pool, host logic on small
token tensors (its string form could not run on the device anyway).
"""

from __future__ import annotations

from tensorkiln.kernels.cuda.host import register_host

register_host(
    ["RegexFullMatch", "StringConcat", "StringNormalizer", "StringSplit"],
    "strings have no device representation (torch has no string tensors)",
)
register_host(
    "TfIdfVectorizer",
    "n-gram matching against a token pool is host logic over small token tensors, and its "
    "string inputs have no device representation",
)
