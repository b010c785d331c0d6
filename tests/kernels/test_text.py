"""String ops and TfIdfVectorizer against onnxruntime on fresh random inputs."""

from __future__ import annotations

import time

import numpy as np
import pytest

from tests.kernels.ort_oracle import check_against_ort, run_kernel, run_ort

WORDS = ["a", "bb", "Ccc", "dD", "éé", "Ünï", "x y", "", "Zz", "monday"]


def _strings(rng, shape, words=WORDS):
    return np.array(rng.choice(words, size=shape).tolist(), dtype=object).reshape(shape)


def test_string_concat_broadcast():
    rng = np.random.default_rng()
    x, y = _strings(rng, (3, 4)), _strings(rng, (4,))
    check_against_ort("StringConcat", {"X": x, "Y": y}, opset=20)
    check_against_ort("StringConcat", {"X": np.array(x[0, 0], dtype=object), "Y": y[:1]}, opset=20)


@pytest.mark.parametrize("delimiter", [None, ",", "::"])
@pytest.mark.parametrize("maxsplit", [None, 1])
def test_string_split(delimiter, maxsplit):
    rng = np.random.default_rng()
    sep = delimiter or " "
    pieces = ["ab", "", "c d", "  ", "e"]
    x = np.array(
        [sep.join(rng.choice(pieces, size=rng.integers(0, 5))) for _ in range(6)], dtype=object
    ).reshape(2, 3)
    attrs = {k: v for k, v in (("delimiter", delimiter), ("maxsplit", maxsplit)) if v is not None}
    check_against_ort("StringSplit", {"X": x}, attrs, n_outputs=2, opset=20)


def test_regex_full_match():
    rng = np.random.default_rng()
    x = _strings(rng, (5, 3), ["ab12", "abc", "12", "ab", "a1b2", "xyz@site.com", ""])
    for pattern in [r"[a-z]+\d*", r"(ab)+", r"\w+@\w+\.com", r".*"]:
        check_against_ort("RegexFullMatch", {"X": x}, {"pattern": pattern}, opset=20)


@pytest.mark.parametrize("action", ["NONE", "LOWER", "UPPER"])
@pytest.mark.parametrize("sensitive", [0, 1])
@pytest.mark.parametrize("two_d", [False, True])
def test_string_normalizer(action, sensitive, two_d):
    rng = np.random.default_rng()
    words = ["Monday", "monday", "tuesday", "MONDAY", "wed", "Thu"]
    x = _strings(rng, (7,), words)
    x = x.reshape(1, -1) if two_d else x
    attrs = {"case_change_action": action, "is_case_sensitive": sensitive}
    attrs["stopwords"] = ["monday", "Thu"]
    attrs["locale"] = "C.UTF-8"  # onnxruntime's default en_US locale may not be installed
    check_against_ort("StringNormalizer", {"X": x}, attrs, opset=10)


def test_string_normalizer_all_dropped():
    x = np.array([["a", "A"]], dtype=object)
    attrs = {"stopwords": ["a"], "case_change_action": "UPPER", "locale": "C.UTF-8"}
    check_against_ort("StringNormalizer", {"X": x}, attrs, opset=10)
    got = run_kernel("StringNormalizer", {"X": x[0]}, attrs, opset=10)[0]
    assert got.shape == (1,) and got[0] == ""


def _tfidf_attrs(rng, mode, strings):
    vocab = ["w0", "w1", "w2", "w3", "w4"] if strings else [2, 3, 5, 7, 11]
    unigrams = list(rng.choice(vocab, size=3, replace=False))
    pairs = [(a, b) for a in vocab for b in vocab]  # pool n-grams must be distinct
    bigrams = [g for i in rng.choice(len(pairs), size=4, replace=False) for g in pairs[i]]
    trigrams = list(rng.choice(vocab, size=3))
    pool = unigrams + bigrams + trigrams
    n_grams = 3 + 4 + 1
    attrs = {
        "mode": mode,
        "min_gram_length": int(rng.integers(1, 3)),
        "max_gram_length": 3,
        "max_skip_count": int(rng.integers(0, 3)),
        "ngram_counts": [0, 3, 11],
        "ngram_indexes": list(rng.permutation(n_grams)),
        "weights": list(rng.uniform(0.5, 2.0, size=n_grams)),
    }
    attrs["pool_strings" if strings else "pool_int64s"] = [
        str(p) if strings else int(p) for p in pool
    ]
    return attrs, vocab


@pytest.mark.parametrize("mode", ["TF", "IDF", "TFIDF"])
@pytest.mark.parametrize("strings", [False, True])
def test_tfidf_vectorizer(mode, strings):
    rng = np.random.default_rng()
    attrs, vocab = _tfidf_attrs(rng, mode, strings)
    tokens = [*vocab, "other" if strings else 4]
    for shape in [(12,), (3, 9)]:
        x = rng.choice(np.array(tokens, dtype=object if strings else np.int64), size=shape)
        if not strings and rng.random() < 0.5:
            x = x.astype(np.int32)
        check_against_ort("TfIdfVectorizer", {"X": x}, attrs, opset=9)


def test_tfidf_unigrams_only_with_skips():
    rng = np.random.default_rng()
    x = rng.integers(0, 6, size=(4, 10)).astype(np.int64)
    attrs = {
        "mode": "TF",
        "min_gram_length": 1,
        "max_gram_length": 1,
        "max_skip_count": 3,
        "ngram_counts": [0],
        "ngram_indexes": [0, 1, 2],
        "pool_int64s": [1, 3, 5],
    }
    got = check_against_ort("TfIdfVectorizer", {"X": x}, attrs, opset=9)[0]
    np.testing.assert_array_equal(got, np.stack([(x == v).sum(1) for v in (1, 3, 5)], 1))


def _regex_model(pattern: str, x: np.ndarray | None = None):
    """RegexFullMatch of the input X, or of a Constant holding ``x`` when it is given."""
    from onnx import TensorProto, helper

    nodes = [helper.make_node("RegexFullMatch", ["X"], ["Y"], pattern=pattern)]
    inputs = [helper.make_tensor_value_info("X", TensorProto.STRING, [None])]
    if x is not None:
        value = helper.make_tensor("c", TensorProto.STRING, x.shape, [s.encode() for s in x])
        nodes.insert(0, helper.make_node("Constant", [], ["X"], value=value))
        inputs = []
    out = helper.make_tensor_value_info("Y", TensorProto.BOOL, [None])
    graph = helper.make_graph(nodes, "regex", inputs, [out])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10)


@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_regex_nested_quantifiers_answer_in_linear_time(backend):
    """``(a+)+b`` backtracks exponentially in Python's ``re``; RE2 answers at once, as onnxruntime."""
    from tensorkiln.builder import Builder
    from tensorkiln.kernels.registry import has_kernel

    if backend == "cuda":
        pytest.importorskip("torch")
    assert has_kernel("RegexFullMatch", "", backend)
    rng = np.random.default_rng()
    n = 40
    x = np.array(
        ["a" * n, "a" * n + "b", "a" * int(rng.integers(1, n)) + "c", "b", ""], dtype=object
    )
    x = x[rng.permutation(len(x))]
    pattern = "(a+)+b"
    want = run_ort(_regex_model(pattern), {"X": x})[0]
    builder = Builder(backend, device="cpu" if backend == "cuda" else None)
    t0 = time.perf_counter()
    got = builder.build(_regex_model(pattern), progress=False).create_execution_context()
    got = got.infer({"X": x})["Y"]
    folded = builder.build(_regex_model(pattern, x), progress=False).create_execution_context()
    folded = folded.infer({})["Y"]
    assert time.perf_counter() - t0 < 10.0  # backtracking needs ~2**40 steps
    np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_array_equal(np.asarray(folded), want)


def test_regex_invalid_pattern_is_a_clear_error():
    from tensorkiln.builder import Builder
    from tensorkiln.errors import TensorkilnError

    x = np.array(["ab", "(a"], dtype=object)
    ctx = Builder("reference").build(_regex_model("(a"), progress=False)
    with pytest.raises(TensorkilnError, match=r"RegexFullMatch.*'\(a'.*not a valid RE2.*pattern"):
        ctx.create_execution_context().infer({"X": x})
    with pytest.raises(TensorkilnError, match="not a valid RE2"):
        run_kernel("RegexFullMatch", {"X": x}, {"pattern": "a{2,1}"}, opset=20)


def test_regex_without_re2_refuses_and_names_the_package(monkeypatch):
    """No silent fallback to Python's backtracking ``re``."""
    import sys

    from tensorkiln.errors import UnsupportedOpError
    from tensorkiln.kernels.reference import text

    text._compile_re2.cache_clear()
    monkeypatch.setitem(sys.modules, "re2", None)  # import re2 now raises ImportError
    x = np.array(["ab"], dtype=object)
    with pytest.raises(UnsupportedOpError, match="pip install google-re2"):
        run_kernel("RegexFullMatch", {"X": x}, {"pattern": "a+b"}, opset=20)
    text._compile_re2.cache_clear()


def test_regex_follows_re2_where_python_re_differs():
    r"""RE2's ``\d`` and ``\w`` are ASCII where Python's are Unicode, and RE2 knows POSIX classes:
    the answers are onnxruntime's, which uses RE2 too."""
    rng = np.random.default_rng()
    words = ["١٢٣", "123", "éa", "ea", "a1", "ß"]
    x = np.array([words[i] for i in rng.permutation(len(words))], dtype=object)
    for pattern in [r"\d+", r"\w+", r"[[:alpha:]]+\d?", r"(?i)EA"]:
        check_against_ort("RegexFullMatch", {"X": x}, {"pattern": pattern}, opset=20)
