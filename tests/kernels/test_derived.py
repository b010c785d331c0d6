"""kernels/derived.py: inside a scope (one run of an engine) a value derived from a tensor is
computed once per tensor object, again after the tensor is written; outside any scope, and in
the next scope, it is computed anew."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tensorkiln.kernels.derived import derived, scope  # noqa: E402


def test_once_per_object_and_version_within_a_scope() -> None:
    rng = np.random.default_rng()
    mask = torch.from_numpy(rng.integers(0, 2, (4, 9)))
    calls = []

    def rows():
        calls.append(1)
        return mask.sum(dim=1)

    derived(mask, "rows", rows)
    derived(mask, "rows", rows)
    assert len(calls) == 2  # (no scope: every time)
    with scope():
        first = derived(mask, "rows", rows)
        assert derived(mask, "rows", rows) is first and len(calls) == 3
        assert torch.equal(first, mask.sum(dim=1))
        derived(mask, "other key", rows)
        assert len(calls) == 4
        mask.add_(1)  # written in place: its version moves, the value is made again
        again = derived(mask, "rows", rows)
        assert len(calls) == 5 and torch.equal(again, mask.sum(dim=1))
        twin = mask.clone()  # an equal tensor is another object: computed for it
        assert derived(twin, "rows", lambda: twin.sum(dim=1) * 0).sum() == 0
        with scope():  # (a nested scope shares the outer one)
            assert derived(mask, "rows", rows) is again
    with scope():  # the next run: nothing carried over, even for the same object
        derived(mask, "rows", rows)
    assert len(calls) == 6
