"""benchmarks/cutlass_gemm_build.py's own logic, without the DSL: the tile grammar, reading the
exported header, and refusing an example its patches do not fit (each patch must match once)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "cutlass_gemm_build.py"


@pytest.fixture(scope="module")
def build():
    spec = importlib.util.spec_from_file_location("cutlass_gemm_build", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiles_parse_and_bad_ones_are_refused(build) -> None:
    no = (False, False, False)  # (promoted sums, vectors staged, two residual buffers)
    assert build._tile("128x256") == (128, 256, 1, 4, None, 4, (1, 1), 0, *no)
    assert build._tile("128x128o2k2e64x128s8") == (128, 128, 2, 2, (64, 128), 8, (1, 1), 0, *no)
    assert build._tile("128x128c2x1") == (128, 128, 1, 4, None, 4, (2, 1), 0, *no)
    assert build._tile("128x128c1x2w2") == (128, 128, 1, 4, None, 4, (1, 2), 2, *no)
    assert build._tile("128x128w2p") == (128, 128, 1, 4, None, 4, (1, 1), 2, True, False, False)
    assert build._tile("128x128o2c1x2v") == (128, 128, 2, 4, None, 4, (1, 2), 0, False, True, False)
    assert build._tile("128x64p")[-3] and build._tile("64x128pv")[-3:-1] == (True, True)
    assert build._tile("128x64o2k2vd")[-3:] == (False, True, True)
    # promoted sums need a second accumulator: only where the first is 64 registers a thread
    for bad in ("128x128p", "128x256p", "128x256w2p"):
        with pytest.raises(SystemExit, match="second accumulator"):
            build._tile(bad)
    for bad in ("96x128", "128x32", "128x128o3", "128x128k3", "128x128e64", "128x128s5", "x",
                "128x128c4x1", "128x128c2x1o2", "128x128w3", "128x128w2c1x2", "128x64vp",
                "128x64dv"):  # fmt: skip
        with pytest.raises(SystemExit, match="is not MxN"):
            build._tile(bad)
    for spec in (*build.TILES, *build.RESIDUAL_TILES):  # (the defaults are all well formed)
        build._tile(spec)
    assert all(build._tile(spec)[-1] for spec in build.RESIDUAL_TILES)


# The shape of what ``export_to_c`` writes (DSL 4.8.1): one struct per tensor argument with its
# dynamic extents, and the C entry point taking the packed argument pointers.
_HEADER = """
typedef struct {
    void *data;
    int32_t dynamic_shapes[2];
    int64_t dynamic_strides[2];
} k_Tensor_a_t;

typedef struct {
    void *data;
    int32_t dynamic_shapes[1];
} k_Tensor_col_t;

typedef struct {
    void *data;
    int32_t dynamic_shapes[2];
    int64_t dynamic_strides[1];
} k_Tensor_res_t;

void _mlir_k__mlir_ciface_cutlass___call___Kernel_object_at__x(void **args, int32_t num_args);
"""


def test_header_entry_point_and_tensor_extents(build) -> None:
    entry, tensors = build._header_entry(_HEADER)
    assert entry == "_mlir_k__mlir_ciface_cutlass___call___Kernel_object_at__x"
    # (a vector without dynamic strides is not listed: the loader passes it as a pointer and N)
    assert tensors == {"a": [2, 2], "res": [2, 1]}
    with pytest.raises(SystemExit, match="no entry point"):
        build._header_entry(_HEADER.replace("void **args", "void *args"))


def _anchors(*groups) -> str:
    """A stand-in example: each patch's anchor once, leaving out those an earlier patch writes."""
    seen, written, text = set(), "", ""
    for group in groups:
        for old, new in group:
            if old not in seen and old not in written:
                text += old
                seen.add(old)
            written += new
    return text


def test_patches_apply_once_each_and_refuse_another_example(build, tmp_path: Path) -> None:
    source = tmp_path / "example.py"
    base = [
        build._OCCUPANCY_PATCH,
        *build._SHAPE_PATCHES,
        *build._CONV_PATCHES,
        *build._PROMOTE_PATCHES,
    ]
    post = [build._POST_SCALE_PATCH]
    source.write_text(_anchors(base, build._CHANNEL_PATCHES, post, build._RESIDUAL_PATCHES,
                               build._VECTOR_PATCHES))  # fmt: skip
    patched = build._patched_source(source, tmp_path, "channel").read_text()
    for _, new in (*base, *post):
        assert new in patched
    assert "mCol_mnl: cute.Tensor" in patched
    assert "mRes_mnl" not in patched  # (the residual's patches are the residual's own)
    # the output scale after the activation is the channel epilogue's alone
    assert "activation = activation * scale_ab" in patched
    scaled_first = build._patched_source(source, tmp_path, "scalar").read_text()
    assert "acc_vec = acc_vec * scale_ab" in scaled_first
    assert "activation = activation * scale_ab" not in scaled_first

    scalar = build._patched_source(source, tmp_path, "scalar").read_text()
    assert "mCol_mnl" not in scalar and "min_blocks_per_mp=self.occupancy" in scalar

    # an anchor missing, or found twice: the example is not the one the patches were written for
    source.write_text(_anchors(base))
    with pytest.raises(SystemExit, match="is not the example this patch fits"):
        build._patched_source(source, tmp_path, "channel")
    source.write_text(_anchors(base) * 2)
    with pytest.raises(SystemExit, match="is not the example this patch fits"):
        build._patched_source(source, tmp_path, "scalar")


def test_conv_geometries_parse_and_bad_ones_are_refused(build) -> None:
    assert build._conv("3x3s1") == (3, 1, 1)
    assert build._conv("3x3s2") == (3, 1, 2)
    assert build._conv("1x1s2") == (1, 0, 2)
    for bad in ("3x1s1", "5x5s1", "3x3s3", "3x3", "1x1s2 ", ""):
        with pytest.raises(SystemExit, match="is not 3x3s1"):
            build._conv(bad)
    for spec in build.CONVS:  # (the defaults are all well formed)
        build._conv(spec.split(":")[0])
        build._tile(build.CONV_TILES[0])


def test_the_conv_patches_leave_the_gemms_path_as_it_was(build, tmp_path: Path) -> None:
    """The im2col reading of A is taken only where the build set ``tk_conv``, and the stage cap
    is unset (the GEMMs' stage count) unless the build sets it."""
    for _, new in build._CONV_PATCHES:
        assert "tk_conv" in new or "TK_MAX_AB_STAGES" in new
    stage_cap = build._CONV_PATCHES[3][1]
    assert "globals().get('TK_MAX_AB_STAGES') or ab_stage" in stage_cap


def test_promoted_tiles_are_built_for_e4m3_operands_only(build) -> None:
    """int8 sums are exact (int32): its variants get no promoted tiles."""
    assert build._with_promoted("128x64,128x128", "128x64p", "fp8_fp8") == [
        "128x64", "128x128", "128x64p"
    ]  # fmt: skip
    assert build._with_promoted("128x64,128x128", "128x64p", "fp8_f16")[-1] == "128x64p"
    assert build._with_promoted("128x64,128x128", "128x64p", "i8_i8") == ["128x64", "128x128"]
    assert build._with_promoted("128x64", "", "fp8_fp8") == ["128x64"]
    assert build._with_promoted("128x64", "128x64p", "fp8_fp8", "128x64v") == [
        "128x64", "128x64p", "128x64v"
    ]  # fmt: skip
    for spec in build.PROMOTE_TILES:
        assert build._tile(spec)[-3]
    for spec in (*build.VECTOR_TILES, *build.CONV_VECTOR_TILES):
        assert build._tile(spec)[-2]
    # the promoting branch is taken only where the build set tk_promote
    for _, new in build._PROMOTE_PATCHES:
        assert "tk_promote" in new


def test_staged_vectors_replace_the_epilogues_reads_only_where_asked(build, tmp_path) -> None:
    """The channel and residual epilogues read ``col`` and ``bias`` from global memory unless the
    build set ``tk_vec_smem``, then from their copy in shared memory (``tk_cols``,
    ``tk_biases``), made with cp.async when the tile starts and waited for before the epilogue."""
    source = tmp_path / "example.py"
    base = [build._OCCUPANCY_PATCH, *build._SHAPE_PATCHES, *build._CONV_PATCHES,
            *build._PROMOTE_PATCHES]  # fmt: skip
    source.write_text(_anchors(base, build._CHANNEL_PATCHES, [build._POST_SCALE_PATCH],
                               build._RESIDUAL_PATCHES, build._VECTOR_PATCHES))  # fmt: skip
    for epilogue in ("channel", "residual"):
        patched = build._patched_source(source, tmp_path, epilogue).read_text()
        # (the unstaged epilogue keeps the example's own expression: its code is unchanged)
        assert "tk_cols if getattr(self, 'tk_vec_smem', False)" in patched
        assert "else gCol_mnl[(None, None, *tile_coord_mnl)], self.epi_tile, tk_coord" in patched
        assert patched.count("cute.nvgpu.cpasync.CopyG2SOp(), cutlass.Float32") == 1
    assert "tk_cols" not in build._patched_source(source, tmp_path, "scalar").read_text()


def test_the_residual_tile_is_read_from_padded_rows_and_two_buffers_where_asked(
    build, tmp_path: Path
) -> None:
    """The residual's shared-memory rows are N + 16 bytes apart (rows a multiple of 128 bytes
    apart put a warp's eight rows in two banks), and the second buffer, the scheduler one tile
    ahead and the wait for all but the newest group of copies are taken only where the build
    set ``tk_res_double``; a staged-vector kernel's own wait leaves that group in flight too
    (``tk_groups_ahead``)."""
    source = tmp_path / "example.py"
    base = [build._OCCUPANCY_PATCH, *build._SHAPE_PATCHES, *build._CONV_PATCHES,
            *build._PROMOTE_PATCHES]  # fmt: skip
    source.write_text(_anchors(base, build._CHANNEL_PATCHES, [build._POST_SCALE_PATCH],
                               build._RESIDUAL_PATCHES, build._VECTOR_PATCHES))  # fmt: skip
    patched = build._patched_source(source, tmp_path, "residual").read_text()
    assert patched.count("(self.tile_shape_mnk[1] + 16)") == 3  # (size, row stride, buffer)
    double = "getattr(self, 'tk_res_double', False)"
    assert f"if cutlass.const_expr({double}):" in patched
    assert f"cute.arch.cp_async_wait_group(1 if {double} else 0)" in patched
    assert "tk_ahead.advance_to_next_work()" in patched
    assert "sR[(None, None, 1 - tk_rbuf)]" in patched
    assert "cute.arch.cp_async_wait_group(getattr(self, 'tk_groups_ahead', 0))" in patched
    # the staged vectors are requested before the next tile's residual: the epilogue's wait for
    # all but the newest group covers them
    tile_start = patched.index("gC_mnl_slice = gC_mnl[(None, None, *tile_coord_mnl)]")
    assert tile_start < patched.index("tk_svec = storage.sV") < patched.index("tk_next = ")
    channel = build._patched_source(source, tmp_path, "channel").read_text()
    assert "tk_res_double" not in channel and "sR" not in channel
