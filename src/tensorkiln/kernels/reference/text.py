"""String operators and TfIdfVectorizer.

Strings are numpy object arrays of Python ``str``; per-element string work uses ``np.frompyfunc``
or list comprehensions (there is no faster numpy form for Python strings).
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import numpy as np

from tensorkiln.errors import GraphError, UnsupportedOpError
from tensorkiln.kernels.registry import register


def _as_str_array(values: object, shape: tuple[int, ...]) -> np.ndarray:
    out = np.empty(shape, dtype=object)
    out[...] = values
    return out


@register("StringConcat", since=1)
def string_concat(X: np.ndarray, Y: np.ndarray) -> np.ndarray:
    """Elementwise ``X + Y`` of two broadcastable string tensors."""
    shape = np.broadcast_shapes(X.shape, Y.shape)
    return _as_str_array(np.frompyfunc(operator.add, 2, 1)(X, Y), shape)


def _re2() -> Any:
    """The RE2 binding. Python's ``re`` is no substitute: ONNX specifies RE2's semantics, and a
    backtracking engine takes exponential time on patterns like ``(a+)+b`` from a stranger's model.
    """
    try:
        import re2  # imported when used: without it only models with RegexFullMatch fail
    except ImportError:
        raise UnsupportedOpError(
            "RegexFullMatch needs the RE2 binding, which this Python lacks; "
            "install it with: pip install google-re2"
        ) from None
    return re2


@functools.lru_cache(maxsize=64)
def _compile_re2(pattern: str) -> Any:
    re2 = _re2()
    options = re2.Options()
    options.log_errors = False  # the error goes into our message, not onto stderr
    try:
        return re2.compile(pattern, options)
    except re2.error as exc:
        why = (
            exc.args[0].decode(errors="replace")
            if exc.args and isinstance(exc.args[0], bytes)
            else str(exc)
        )
        raise GraphError(
            f"RegexFullMatch: the pattern {pattern!r} is not a valid RE2 regular expression "
            f"({why}); fix the node's 'pattern' attribute"
        ) from None


@register("RegexFullMatch", since=1)
def regex_full_match(X: np.ndarray, *, pattern: str | None = None) -> np.ndarray:
    """Whether each string matches ``pattern`` entirely, with RE2's semantics (linear time)."""
    if pattern is None:
        raise GraphError("RegexFullMatch: the 'pattern' attribute is required")
    regex = _compile_re2(pattern)
    flat = [regex.fullmatch(s) is not None for s in X.reshape(-1)]
    return np.array(flat, dtype=np.bool_).reshape(X.shape)


@register("StringSplit", since=1)
def string_split(
    X: np.ndarray, *, delimiter: str | None = None, maxsplit: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Split each string on ``delimiter`` (runs of whitespace if empty or unset).

    Returns the parts padded with "" to ``X.shape + (most parts,)`` and the int64 part counts.
    """
    sep = delimiter or None
    limit = -1 if maxsplit is None else int(maxsplit)
    # An empty string has no parts whatever the delimiter (as onnxruntime; Python gives [""]).
    # Splitting on whitespace ignores leading and trailing whitespace, also with maxsplit.
    flat = [s.strip() if sep is None else s for s in X.reshape(-1)]
    parts = [s.split(sep, limit) if s else [] for s in flat]
    counts = np.array([len(p) for p in parts], dtype=np.int64).reshape(X.shape)
    width = int(counts.max(initial=0))
    Y = np.full((len(parts), width), "", dtype=object)
    for i, p in enumerate(parts):
        Y[i, : len(p)] = p
    return Y.reshape(*X.shape, width), counts


def _change_case(values: list[str], action: str) -> list[str]:
    if action == "LOWER":
        return [s.lower() for s in values]
    if action == "UPPER":
        return [s.upper() for s in values]
    if action == "NONE":
        return values
    raise ValueError(
        f"StringNormalizer: case_change_action must be NONE, LOWER or UPPER, got {action!r}."
    )


@register("StringNormalizer", since=1)
def string_normalizer(
    X: np.ndarray,
    *,
    case_change_action: str = "NONE",
    is_case_sensitive: int = 0,
    locale: str = "",
    stopwords: list[str] | None = None,
) -> np.ndarray:
    """Drop the elements of X that are stopwords, then change their case.

    X must be [C] or [1, C]; when every element is dropped the result is [""] (shape [1] or [1, 1]).
    """
    if not (X.ndim == 1 or (X.ndim == 2 and X.shape[0] == 1)):
        raise ValueError(f"StringNormalizer: input must be [C] or [1, C], got shape {X.shape}.")
    values = list(X.reshape(-1))
    if stopwords:
        if is_case_sensitive:
            stops = set(stopwords)
            values = [s for s in values if s not in stops]
        else:
            stops = {w.lower() for w in stopwords}
            values = [s for s in values if s.lower() not in stops]
    values = _change_case(values, case_change_action) or [""]
    out = np.array(values, dtype=object)
    return out if X.ndim == 1 else out.reshape(1, -1)


# ----------------------------------------------------------------------------- TfIdfVectorizer


def _token_ids(X: np.ndarray, vocab: np.ndarray) -> np.ndarray:
    """The index of each token of X in ``vocab`` (sorted unique pool values), -1 if absent."""
    if X.dtype == object:
        lut = {t: i for i, t in enumerate(vocab.tolist())}
        flat = np.array([lut.get(t, -1) for t in X.reshape(-1)], dtype=np.int64)
        return flat.reshape(X.shape)
    pos = np.searchsorted(vocab, X).clip(0, max(len(vocab) - 1, 0))
    found = vocab[pos] == X if len(vocab) else np.zeros(X.shape, dtype=bool)
    return np.where(found, pos, -1)


def _pool_ngrams(
    pool: np.ndarray, ngram_counts: list[int], ngram_indexes: list[int], max_n: int
) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Map n to (the pool's n-grams as an [k, n] array, their output indexes)."""
    starts = [*ngram_counts, len(pool)]
    out, k = {}, 0
    for n in range(1, min(len(ngram_counts), max_n) + 1):
        grams = pool[starts[n - 1] : starts[n]]
        if len(grams) % n:
            raise ValueError(
                f"TfIdfVectorizer: the pool holds {len(grams)} values for {n}-grams, "
                f"not a multiple of {n}."
            )
        count = len(grams) // n
        out[n] = (grams.reshape(count, n), np.asarray(ngram_indexes[k : k + count]))
        k += count
    return out


def _count_ngrams(
    ids: np.ndarray, grams: np.ndarray, out_idx: np.ndarray, skips: range, counts: np.ndarray
) -> None:
    """Add to ``counts`` [rows, width] the occurrences in ``ids`` [rows, C] of ``grams`` [k, n]."""
    rows, C = ids.shape
    n = grams.shape[1]
    for skip in skips:
        span = (n - 1) * (skip + 1)
        if span >= C or not len(grams):
            continue
        cols = np.arange(C - span)[:, None] + np.arange(n) * (skip + 1)
        windows = ids[:, cols].reshape(-1, n)
        _, inverse = np.unique(np.concatenate([grams, windows]), axis=0, return_inverse=True)
        inverse = inverse.reshape(-1)
        lut = np.full(inverse.max() + 1, -1, dtype=np.int64)
        lut[inverse[: len(grams)]] = out_idx
        hit = lut[inverse[len(grams) :]]
        row = np.repeat(np.arange(rows), C - span)
        keep = hit >= 0
        np.add.at(counts, (row[keep], hit[keep]), 1)


@register("TfIdfVectorizer", since=1)
def tfidf_vectorizer(
    X: np.ndarray,
    *,
    max_gram_length: int,
    max_skip_count: int,
    min_gram_length: int,
    mode: str,
    ngram_counts: list[int],
    ngram_indexes: list[int],
    pool_int64s: list[int] | None = None,
    pool_strings: list[str] | None = None,
    weights: list[float] | None = None,
) -> np.ndarray:
    """Count the pool's n-grams (min..max length, up to ``max_skip_count`` skipped tokens between
    items) in each row of X ([C] or [N, C]) and weight them by ``mode`` (TF, IDF or TFIDF)."""
    if mode not in ("TF", "IDF", "TFIDF"):
        raise ValueError(f"TfIdfVectorizer: mode must be TF, IDF or TFIDF, got {mode!r}.")
    if (pool_int64s is None) == (pool_strings is None):
        raise ValueError("TfIdfVectorizer: give exactly one of pool_int64s and pool_strings.")
    if X.ndim not in (1, 2):
        raise ValueError(f"TfIdfVectorizer: input must be [C] or [N, C], got shape {X.shape}.")
    raw_pool = np.array(pool_strings if pool_int64s is None else pool_int64s)
    vocab = np.unique(raw_pool)
    pool = _token_ids(raw_pool.astype(object) if pool_int64s is None else raw_pool, vocab)
    ids = _token_ids(X.reshape(1, -1) if X.ndim == 1 else X, vocab)
    width = max(ngram_indexes) + 1 if len(ngram_indexes) else 0
    counts = np.zeros((ids.shape[0], width), dtype=np.float32)
    for n, (grams, out_idx) in _pool_ngrams(
        pool, ngram_counts, ngram_indexes, max_gram_length
    ).items():
        if n >= min_gram_length:
            skips = range(1) if n == 1 else range(max_skip_count + 1)
            _count_ngrams(ids, grams, out_idx, skips, counts)
    # weights[i] belongs to the i-th pool n-gram, whose output slot is ngram_indexes[i]
    w = np.ones(width, np.float32)
    if weights is not None:
        w[np.asarray(ngram_indexes)] = np.asarray(weights, np.float32)
    if mode == "IDF":
        counts = (counts > 0).astype(np.float32) * w
    elif mode == "TFIDF":
        counts = counts * w
    return counts.reshape(-1) if X.ndim == 1 else counts
