import numpy as np

from tests.kernels.ort_oracle import one_node_model, run_ort


def test_ort_oracle_runs_a_one_node_model():
    rng = np.random.default_rng()
    x = rng.standard_normal((3, 4)).astype(np.float32)
    (y,) = run_ort(one_node_model("Neg", {"X": x}), {"X": x})
    np.testing.assert_array_equal(y, -x)
