"""Run ONNX backend node test cases whose name matches a pattern straight through the kernel registry.

A development aid for kernel authors: each single-node case calls the registered reference kernel
directly (no importer, no graph) and compares every output with the expected one. Cases with more
than one node are listed as skipped; the full conformance suite (tests/conformance) runs those.

    python scripts/check_node_tests.py 'test_conv' 'test_relu'
"""

from __future__ import annotations

import re
import sys
import traceback
import warnings

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnx.backend.test.loader import load_model_tests

from tensorkiln.kernels.registry import lookup, normalize_domain


def _attrs(node):
    out = {}
    for a in node.attribute:
        v = helper.get_attribute_value(a)
        if isinstance(v, bytes):
            v = v.decode()
        elif isinstance(v, list) and v and isinstance(v[0], bytes):
            v = [s.decode() for s in v]
        elif hasattr(v, "data_type") and hasattr(v, "dims"):
            v = numpy_helper.to_array(v)
        out[a.name] = v
    return out


def _np(t):
    """ONNX's loader hands some data (float8, int4, ...) over as TensorProtos."""
    return numpy_helper.to_array(t) if isinstance(t, onnx.TensorProto) else t


def _compare(name, got, exp, rtol, atol):
    if isinstance(exp, list):
        assert isinstance(got, list) and len(got) == len(exp), f"{name}: sequence length differs"
        for g, e in zip(got, exp):
            _compare(name, g, e, rtol, atol)
        return
    if exp is None:
        assert got is None, f"{name}: expected an empty optional"
        return
    got = np.asarray(got)
    assert got.shape == exp.shape, f"{name}: shape {got.shape} != expected {exp.shape}"
    assert got.dtype == exp.dtype, f"{name}: dtype {got.dtype} != expected {exp.dtype}"
    if exp.dtype == object:
        assert (got == exp).all(), f"{name}: values differ"
    elif exp.dtype.kind in "fc" or exp.dtype.itemsize < 1 or exp.dtype.kind == "V":
        np.testing.assert_allclose(
            got.astype(np.float64), exp.astype(np.float64), rtol=rtol, atol=atol, err_msg=name
        )
    else:
        np.testing.assert_array_equal(got, exp, err_msg=name)


def main(patterns: list[str]) -> int:
    warnings.simplefilter("ignore")
    regex = re.compile("|".join(patterns))
    passed = failed = skipped = 0
    for case in load_model_tests(kind="node"):
        if not regex.search(case.name):
            continue
        graph = case.model.graph
        if len(graph.node) != 1:
            print(f"SKIP {case.name}: {len(graph.node)} nodes")
            skipped += 1
            continue
        node = graph.node[0]
        opsets = {normalize_domain(o.domain): o.version for o in case.model.opset_import}
        domain = normalize_domain(node.domain)
        try:
            entry = lookup(node.op_type, domain, opsets.get(domain, 1))
            for inputs, outputs in case.data_sets:
                inputs = [_np(t) for t in inputs]
                outputs = [_np(t) for t in outputs]
                feeds = dict(zip([i.name for i in graph.input], inputs))
                args = [feeds[n] if n else None for n in node.input]
                kwargs = _attrs(node)
                if entry.wants_n_outputs:
                    kwargs["_n_outputs"] = len(node.output)
                res = entry.fn(*args, **kwargs)
                if not isinstance(res, tuple):
                    res = (res,)
                for i, exp in enumerate(outputs):
                    pos = list(node.output).index(graph.output[i].name)
                    _compare(f"{case.name} output {i}", res[pos], exp, case.rtol, case.atol)
            passed += 1
        except Exception as exc:  # report and go on
            failed += 1
            print(f"FAIL {case.name}: {type(exc).__name__}: {exc}".splitlines()[0][:300])
            if "-v" in sys.argv:
                traceback.print_exc()
    print(f"{passed} passed, {failed} failed, {skipped} skipped (multi-node)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main([a for a in sys.argv[1:] if a != "-v"] or ["."]))
