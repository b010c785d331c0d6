"""Compile Hopper WGMMA GEMMs ahead of time with CUTLASS's Python DSL (CuTe DSL), on a machine
without a GPU, into one shared library that ``benchmarks/cutlass_gemm.py`` loads on the GPU.

    python benchmarks/cutlass_gemm_build.py --kernel PATH/dense_gemm_fp8_gelu_persistent.py
        [--out build/cutlass_gemm] [--tiles 128x64,128x128o2k2,...] [--variants ...]

``--kernel`` is CUTLASS's own Hopper example (examples/python/CuTeDSL/cute/hopper/kernel/
dense_gemm/dense_gemm_fp8_gelu_persistent.py in github.com/NVIDIA/cutlass): a persistent,
warp-specialized GEMM with TMA loads and stores, ``D = op(scale * A @ B^T)`` with a compile-time
elementwise ``op``. It is read from where it lies and not copied into this project. The DSL
(``pip install "nvidia-cutlass-dsl[cu13]"``, NVIDIA's licence) is needed here only; what runs on
the GPU is the exported object code, linked with the DSL's small CUDA runtime shim.

Each variant is compiled with dynamic M, N and K (M a multiple of 128, N and K of 16), for sm_90a:
A is M x K and B is N x K, both K-major (a channels-last activation and a weight as stored);
D is M x N, N-major. ``--convs`` adds implicit-GEMM convolutions (``conv3x3s1_...``): the same
kernels with A an NHWC input read through TMA's im2col mode (see ``_CONV_PATCHES``). The manifest (``manifest.json``) names each variant's entry point and its
tensors' dynamic extents, as the exported headers declare them.

The example is patched as it is read (the patches below, each of which must match exactly once,
so another revision of the example is refused rather than half-patched); the figures in
benchmarks/RESULTS.md were measured with CUTLASS at commit 7107b0553 and the DSL 4.8.1.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _load_kernel_module(path: Path):
    spec = importlib.util.spec_from_file_location("cutlass_hopper_gemm_example", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cutlass_gemm_build: cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _header_entry(header: str) -> tuple[str, dict[str, list[int]]]:
    """The exported header's C entry point, and for each tensor argument its dynamic shape and
    stride counts (the fields of its ``<prefix>_Tensor_<name>_t``)."""
    entry = re.search(
        r"void (_mlir_\w+__mlir_ciface_\w+)\(void \*\*args, int32_t num_args\)", header
    )
    if entry is None:
        raise SystemExit("cutlass_gemm_build: no entry point in the exported header")
    tensors = {}
    for shapes, strides, struct in re.findall(
        r"typedef struct \{\s*void \*data;\s*int32_t dynamic_shapes\[(\d+)\];\s*"
        r"int64_t dynamic_strides\[(\d+)\];\s*\} (\w+)_t;",
        header,
    ):
        tensors[struct.rsplit("_Tensor_", 1)[1]] = [int(shapes), int(strides)]
    return entry.group(1), tensors


# The per-channel epilogue (``--epilogue channel``): CUTLASS's example computes ``op(scale * acc)``
# with one scale. A quantized layer needs ``op(acc * col[n] + bias[n])`` (``col``: the input's
# scale times the weight's per-channel scale over the output's scale; ``bias`` likewise divided),
# so the example's text is patched at build time: two float32 vectors of N travel as M x N views
# with a zero row stride, each epilogue subtile reads them through the thread partition of the
# shared-memory tile the fragment is copied to (element i of the fragment lands on element i of
# that partition, so the vectors are read in that order and reshaped to the fragment's shape),
# and the scalar scale is left out. A 16-bit output is stored with ``stmatrix``, whose threads
# write elements other threads hold: there the vectors are read through the copy's source
# partition, the registers' own order (through the destination's, the results came out wrong).
_CHANNEL_PATCHES = (
    (
        "        c: cute.Tensor,\n        scale_ab: cutlass.Float32,",
        "        c: cute.Tensor,\n        col: cute.Tensor,\n        bias: cute.Tensor,\n"
        "        scale_ab: cutlass.Float32,",
    ),
    (
        "        self.shared_storage = SharedStorage\n",
        "        self.shared_storage = SharedStorage\n"
        "        vec_layout = cute.make_layout(\n"
        "            (cute.size(c, mode=[0]), cute.size(c, mode=[1]), 1), stride=(0, 1, 0)\n"
        "        )\n"
        "        col_mnl = cute.make_tensor(col.iterator, vec_layout)\n"
        "        bias_mnl = cute.make_tensor(bias.iterator, vec_layout)\n",
    ),
    (
        "            tma_tensor_c,\n            self.tiled_mma,",
        "            tma_tensor_c,\n            col_mnl,\n            bias_mnl,\n            self.tiled_mma,",
    ),
    (
        "        mC_mnl: cute.Tensor,\n",
        "        mC_mnl: cute.Tensor,\n        mCol_mnl: cute.Tensor,\n        mBias_mnl: cute.Tensor,\n",
    ),
    (
        "        # Partition shared tensor for TMA load A/B\n",
        "        gCol_mnl = cute.local_tile(\n"
        "            mCol_mnl, cute.slice_(self.tile_shape_mnk, (None, None, 0)), (None, None, None)\n"
        "        )\n"
        "        gBias_mnl = cute.local_tile(\n"
        "            mBias_mnl, cute.slice_(self.tile_shape_mnk, (None, None, 0)), (None, None, None)\n"
        "        )\n"
        "        # Partition shared tensor for TMA load A/B\n",
    ),
    (
        "                    acc_vec = tRS_rAcc_epi.load()\n",
        "                    acc_vec = tRS_rAcc_epi.load()\n"
        "                    tk_coord = epi_tile_layout.get_hier_coord(epi_idx)\n"
        "                    tk_part = (\n"
        "                        thr_copy_r2s.partition_S if self.c_dtype.width == 16\n"
        "                        else thr_copy_r2s.partition_D\n"
        "                    )\n"
        "                    tk_col = tk_part(cute.local_tile(\n"
        "                        gCol_mnl[(None, None, *tile_coord_mnl)], self.epi_tile, tk_coord\n"
        "                    )).load().reshape(tRS_rD_layout.shape)\n"
        "                    tk_bias = tk_part(cute.local_tile(\n"
        "                        gBias_mnl[(None, None, *tile_coord_mnl)], self.epi_tile, tk_coord\n"
        "                    )).load().reshape(tRS_rD_layout.shape)\n"
        "                    acc_vec = acc_vec.to(cutlass.Float32) * tk_col + tk_bias\n",
    ),
    # an 8-bit integer output: rounded half to even, as QuantizeLinear rounds, converted to int32
    # (which saturates) and held to [-128, 127] in integers
    (
        "                    tRS_rD_out.store(activation.to(self.c_dtype))\n",
        "                    if cutlass.const_expr(self.c_dtype == cutlass.Int8):\n"
        "                        tk_int = cute.math.roundeven(activation).to(cutlass.Int32)\n"
        "                        tk_int = cute.math.max(\n"
        "                            cute.math.min(tk_int, cute.full_like(tk_int, 127)),\n"
        "                            cute.full_like(tk_int, -128),\n"
        "                        )\n"
        "                        tRS_rD_out.store(tk_int.to(self.c_dtype))\n"
        "                    else:\n"
        "                        tRS_rD_out.store(activation.to(self.c_dtype))\n",
    ),
)


# The channel epilogue's output scale: the example scales the sums before its ``op``; here the
# scale (the scalar argument, where the build asks for it) multiplies the activation's result,
# ``op(acc * col[n] + bias[n]) * scale``. GELU does not commute with a quantized output's
# ``1 / Y_scale`` as ReLU does, so the GELU GEMMs take the output scale after the activation.
_POST_SCALE_PATCH = (
    "                    if cutlass.const_expr(apply_scale):\n"
    "                        acc_vec = acc_vec * scale_ab\n\n"
    "                    activation = epilogue_op(acc_vec)\n",
    "                    activation = epilogue_op(acc_vec)\n"
    "                    if cutlass.const_expr(apply_scale):\n"
    "                        activation = activation * scale_ab\n",
)


# The residual epilogue (``residual``): the channel epilogue plus an 8-bit residual of the
# output's shape and the operands' type (E4M3 or int8) times a scale (the scalar argument, which the channel epilogue leaves unused),
# added before the activation: ``op(acc * col[n] + bias[n] + z * z_scale)``, a ResNet block's
# last convolution with its shortcut. The epilogue's threads copy a tile's residual to shared
# memory with 16-byte cp.async copies when the tile starts, so the copy runs under the tile's main
# loop; the epilogue waits for it, then reads each subtile through the partition the fragment is
# stored with. (Read from global memory through that partition, a byte or two at a time, or
# copied subtile by subtile just before its use, the residual made these layers twice as slow as
# without it.) The tile's rows lie N + 16 bytes apart in shared memory, not N: the fragment's
# threads read two bytes each from eight rows at once, and rows a multiple of 128 bytes apart put
# all eight in the same two banks (eight-way conflicts on every read; N + 16 spreads them over
# sixteen banks).
# Tiles ``...d`` keep two residual buffers: the first tile's residual is requested before the
# loop and each tile requests the next one's (a second scheduler runs one tile ahead) before its
# own main loop, so the copy also runs under this tile's epilogue, and the epilogue waits for all
# but the newest group of copies (``cp.async.wait_group 1``). A buffer is refilled only after the
# last epilogue barrier of the tile that read it. The second buffer costs the main loop stages:
# 128x128o2 keeps one.
# A float16 output (``fp8_f16``, ``i8_f16``: a network's last block, whose sum goes on in float)
# reads the residual through the partition its vectors are read with (the copy's source, as
# ``stmatrix`` stores 16 bits), from a tile of the operands' type.
_RESIDUAL_ROW = "(self.tile_shape_mnk[1] + 16)"
_RESIDUAL_DOUBLE = "getattr(self, 'tk_res_double', False)"
_RESIDUAL_DTYPE = "getattr(self, 'tk_res_dtype', self.c_dtype)"  # (the operands' 8-bit type)
_VECTOR_STAGED = "getattr(self, 'tk_vec_smem', False)"  # (the staged vectors' tiles, below)
_RESIDUAL_PATCHES = (
    ("        bias: cute.Tensor,\n", "        bias: cute.Tensor,\n        res: cute.Tensor,\n"),
    ("            bias_mnl,\n            self.tiled_mma,",
     "            bias_mnl,\n            res,\n            self.tiled_mma,"),
    ("        mBias_mnl: cute.Tensor,\n", "        mBias_mnl: cute.Tensor,\n        mRes_mnl: cute.Tensor,\n"),
    (
        "        # Partition shared tensor for TMA load A/B\n",
        "        gRes_mnl = cute.local_tile(\n"
        "            mRes_mnl, cute.slice_(self.tile_shape_mnk, (None, None, 0)), (None, None, None)\n"
        "        )\n"
        "        # Partition shared tensor for TMA load A/B\n",
    ),
    (
        "                    cute.cosize(self.epi_smem_layout_staged),\n"
        "                ],\n                self.buffer_align_bytes,\n            ]\n",
        "                    cute.cosize(self.epi_smem_layout_staged),\n"
        "                ],\n                self.buffer_align_bytes,\n            ]\n"
        "            sR: cute.struct.Align[\n"
        "                cute.struct.MemRange[\n"
        f"                    {_RESIDUAL_DTYPE},\n"
        f"                    (2 if {_RESIDUAL_DOUBLE} else 1) * self.tile_shape_mnk[0] * {_RESIDUAL_ROW},\n"
        "                ],\n"
        "                128,\n"
        "            ]\n",
    ),
    (
        "        sC = storage.sC.get_tensor(\n"
        "            epi_smem_layout_staged.outer, swizzle=epi_smem_layout_staged.inner\n        )\n",
        "        sC = storage.sC.get_tensor(\n"
        "            epi_smem_layout_staged.outer, swizzle=epi_smem_layout_staged.inner\n        )\n"
        "        sR = storage.sR.get_tensor(\n"
        "            cute.make_layout(\n"
        f"                (self.tile_shape_mnk[0], self.tile_shape_mnk[1], 2 if {_RESIDUAL_DOUBLE} else 1),\n"
        f"                stride=({_RESIDUAL_ROW}, 1, self.tile_shape_mnk[0] * {_RESIDUAL_ROW}),\n"
        "            )\n"
        "        )\n",
    ),
    (
        "            tma_store_pipeline = pipeline.PipelineTmaStore.create(\n"
        "                num_stages=self.epi_stage,\n"
        "                producer_group=tma_store_producer_group,\n"
        "            )\n",
        "            tma_store_pipeline = pipeline.PipelineTmaStore.create(\n"
        "                num_stages=self.epi_stage,\n"
        "                producer_group=tma_store_producer_group,\n"
        "            )\n"
        "            tk_tpr = self.tile_shape_mnk[1] // 16\n"
        "            tk_ld = cute.make_tiled_copy_tv(\n"
        "                cute.make_copy_atom(\n"
        f"                    cute.nvgpu.cpasync.CopyG2SOp(), {_RESIDUAL_DTYPE},\n"
        "                    num_bits_per_copy=128,\n"
        "                ),\n"
        "                cute.make_layout(\n"
        "                    (self.num_mma_threads // tk_tpr, tk_tpr), stride=(tk_tpr, 1)\n"
        "                ),\n"
        "                cute.make_layout((1, 16)),\n"
        "            )\n"
        "            tk_thr = tk_ld.get_slice(\n"
        "                tidx - self.num_dma_warp_groups * self.num_threads_per_warp_group\n"
        "            )\n"
        "            tk_ahead = utils.StaticPersistentTileScheduler.create(\n"
        "                tile_sched_params, cute.arch.block_idx(), cute.arch.grid_dim()\n"
        "            )\n"
        f"            if cutlass.const_expr({_RESIDUAL_DOUBLE}):\n"
        "                if work_tile.is_valid_tile:\n"
        "                    cute.copy(\n"
        "                        tk_ld,\n"
        "                        tk_thr.partition_S(gRes_mnl[(None, None, *work_tile.tile_idx)]),\n"
        "                        tk_thr.partition_D(sR[(None, None, 0)]),\n"
        "                    )\n"
        "                cute.arch.cp_async_commit_group()\n"
        "                tk_ahead.advance_to_next_work()\n",
    ),
    (
        "                gC_mnl_slice = gC_mnl[(None, None, *tile_coord_mnl)]\n",
        "                gC_mnl_slice = gC_mnl[(None, None, *tile_coord_mnl)]\n"
        f"                tk_rbuf = tile_sched.num_tiles_executed % 2 if {_RESIDUAL_DOUBLE} else 0\n"
        f"                if cutlass.const_expr({_RESIDUAL_DOUBLE}):\n"
        "                    tk_next = tk_ahead.get_current_work()\n"
        "                    if tk_next.is_valid_tile:\n"
        "                        cute.copy(\n"
        "                            tk_ld,\n"
        "                            tk_thr.partition_S(gRes_mnl[(None, None, *tk_next.tile_idx)]),\n"
        "                            tk_thr.partition_D(sR[(None, None, 1 - tk_rbuf)]),\n"
        "                        )\n"
        "                    cute.arch.cp_async_commit_group()\n"
        "                    tk_ahead.advance_to_next_work()\n"
        "                else:\n"
        "                    cute.copy(\n"
        "                        tk_ld,\n"
        "                        tk_thr.partition_S(gRes_mnl[(None, None, *tile_coord_mnl)]),\n"
        "                        tk_thr.partition_D(sR[(None, None, 0)]),\n"
        "                    )\n"
        "                    cute.arch.cp_async_commit_group()\n",
    ),
    (
        "                # Epilogue\n",
        "                # Epilogue\n"
        f"                if cutlass.const_expr(not {_VECTOR_STAGED}):\n"
        f"                    cute.arch.cp_async_wait_group(1 if {_RESIDUAL_DOUBLE} else 0)\n"
        "                    self.epilog_sync_barrier.arrive_and_wait()\n",
    ),
    (
        "                    acc_vec = acc_vec.to(cutlass.Float32) * tk_col + tk_bias\n",
        "                    tk_res = tk_part(\n"
        "                        cute.local_tile(sR[(None, None, tk_rbuf)], self.epi_tile, tk_coord)\n"
        "                    ).load().reshape(tRS_rD_layout.shape)\n"
        "                    acc_vec = acc_vec.to(cutlass.Float32) * tk_col + tk_bias + tk_res.to(cutlass.Float32) * scale_ab\n",
    ),
)  # fmt: skip


# The per-channel vectors staged in shared memory (tiles ``...v``): the channel epilogue reads
# each subtile's ``col`` and ``bias`` from global memory after the tile's main loop, one L2
# round trip a subtile between the epilogue's barriers, which a memory-bound layer (a ResNet's
# 1x1 convolutions) cannot hide. With ``tk_vec_smem`` the math warpgroup copies the tile's two
# rows of N floats to shared memory with cp.async when the tile starts (as the residual's tile
# is), so the copy runs under the main loop, and the epilogue reads them from there through the
# same zero-row-stride view. (It waits for every group of copies but, in a residual kernel, the
# newest: the next tile's residual where it has two buffers, ``tk_groups_ahead``.)
_VECTOR_PATCHES = (
    (
        "                    cute.cosize(self.epi_smem_layout_staged),\n"
        "                ],\n                self.buffer_align_bytes,\n            ]\n",
        "                    cute.cosize(self.epi_smem_layout_staged),\n"
        "                ],\n                self.buffer_align_bytes,\n            ]\n"
        "            sV: cute.struct.Align[\n"
        "                cute.struct.MemRange[\n"
        f"                    cutlass.Float32, 2 * self.tile_shape_mnk[1] if {_VECTOR_STAGED} else 0\n"
        "                ],\n"
        "                128,\n"
        "            ]\n",
    ),
    (
        "                gC_mnl_slice = gC_mnl[(None, None, *tile_coord_mnl)]\n",
        "                gC_mnl_slice = gC_mnl[(None, None, *tile_coord_mnl)]\n"
        f"                if cutlass.const_expr({_VECTOR_STAGED}):\n"
        "                    tk_vn = self.tile_shape_mnk[1]\n"
        "                    tk_svec = storage.sV.get_tensor(cute.make_layout((2, tk_vn), stride=(tk_vn, 1)))\n"
        "                    tk_vld = cute.make_tiled_copy_tv(\n"
        "                        cute.make_copy_atom(\n"
        "                            cute.nvgpu.cpasync.CopyG2SOp(), cutlass.Float32,\n"
        "                            num_bits_per_copy=128,\n"
        "                        ),\n"
        "                        cute.make_layout(tk_vn // 4),\n"
        "                        cute.make_layout(4),\n"
        "                    )\n"
        "                    tk_vidx = tidx - self.num_dma_warp_groups * self.num_threads_per_warp_group\n"
        "                    if tk_vidx < tk_vn // 4:\n"
        "                        tk_vthr = tk_vld.get_slice(tk_vidx)\n"
        "                        cute.copy(\n"
        "                            tk_vld,\n"
        "                            tk_vthr.partition_S(gCol_mnl[(None, None, *tile_coord_mnl)][(0, None)]),\n"
        "                            tk_vthr.partition_D(tk_svec[(0, None)]),\n"
        "                        )\n"
        "                        cute.copy(\n"
        "                            tk_vld,\n"
        "                            tk_vthr.partition_S(gBias_mnl[(None, None, *tile_coord_mnl)][(0, None)]),\n"
        "                            tk_vthr.partition_D(tk_svec[(1, None)]),\n"
        "                        )\n"
        "                    cute.arch.cp_async_commit_group()\n"
        "                    tk_rows = cute.make_layout(\n"
        "                        (self.tile_shape_mnk[0], tk_vn), stride=(0, 1)\n"
        "                    )\n"
        "                    tk_cols = cute.make_tensor(tk_svec[(0, None)].iterator, tk_rows)\n"
        "                    tk_biases = cute.make_tensor(tk_svec[(1, None)].iterator, tk_rows)\n",
    ),
    (
        "                # Epilogue\n",
        "                # Epilogue\n"
        f"                if cutlass.const_expr({_VECTOR_STAGED}):\n"
        "                    cute.arch.cp_async_wait_group(getattr(self, 'tk_groups_ahead', 0))\n"
        "                    self.epilog_sync_barrier.arrive_and_wait()\n",
    ),
    (
        "                        gCol_mnl[(None, None, *tile_coord_mnl)], self.epi_tile, tk_coord\n",
        f"                        tk_cols if {_VECTOR_STAGED}\n"
        "                        else gCol_mnl[(None, None, *tile_coord_mnl)], self.epi_tile, tk_coord\n",
    ),
    (
        "                        gBias_mnl[(None, None, *tile_coord_mnl)], self.epi_tile, tk_coord\n",
        f"                        tk_biases if {_VECTOR_STAGED}\n"
        "                        else gBias_mnl[(None, None, *tile_coord_mnl)], self.epi_tile, tk_coord\n",
    ),
)  # fmt: skip


# Two CTAs an SM (``--tiles 128x128o2``): the example launches with ``min_blocks_per_mp=1`` whatever
# its occupancy; the launch bound follows the occupancy here, so the compiler keeps each thread to
# half the register file, and the MMA warp group takes 216 of them once the load warp group has
# given its share back (40 + 216 = 2 x 128). The shared-memory carveout is stated (all of it),
# since the DSL would otherwise ask the GPU for it while compiling. (64x256o2 does not compile:
# ptxas wants 154 registers a thread for its 64 x 256 WGMMA under a launch bound of 128.)
_OCCUPANCY_PATCH = (
    "            min_blocks_per_mp=1,\n",
    "            min_blocks_per_mp=self.occupancy,\n"
    "            preferred_smem_carveout=100 if self.occupancy > 1 else None,\n",
)


# The K depth of a main-loop stage (``k2``: two WGMMA K steps, 64 bytes, for layers whose K is 64,
# where the example's four would multiply zeros), the epilogue subtile (``e128x64``) and the
# number of epilogue stages (``s8``: TMA stores in flight; the example waits once three of its
# four are, which bounds a CTA's stores to 12-16 KB in flight) become settable from the build.
_SHAPE_PATCHES = (
    ("        mma_inst_tile_k = 4\n", "        mma_inst_tile_k = getattr(self, 'k_steps', 4)\n"),
    (
        "            self.tile_shape_mnk, self.c_dtype, is_cooperative=is_cooperative\n",
        "            self.tile_shape_mnk, self.c_dtype, is_cooperative=is_cooperative,\n"
        "            epi_tile_override=getattr(self, 'epi_tile', None),\n",
    ),
    # (a static method: the count comes from a module global the build sets per variant)
    ("        epi_stage = 4\n", "        epi_stage = globals().get('TK_EPI_STAGES', 4)\n"),
)


# Implicit-GEMM convolutions (``--convs``): the same kernel with A read by TMA's im2col mode. A
# conv kernel's A is the NHWC input seen as (N, D = 1, H, W, C); the TMA descriptor walks the
# output pixels of a tile (M: images x rows x columns, any extents) and, for each K step, one
# window tap (r, s) and ``BLOCK_K`` channels, with the padding's pixels filled with zeros by the
# TMA unit. The K steps run channels first, then s, then r (the im2col tensor's K mode is
# (C, S, R, T)), which is the order of an OHWI weight's columns: B stays the GEMM's 2-D
# (out channels x KH*KW*C) operand, and D the GEMM's (pixels x out channels) output, so only A's
# descriptor and its tiling change. ``tk_conv`` (kernel, pad, stride) is set by the build on the
# conv kernels only; the GEMMs' text paths are unchanged. The main loop's stages are capped
# (``TK_MAX_AB_STAGES``, unset for the GEMMs), since 64-byte stages leave room for 18 of them.
_CONV_PATCHES = (
    (
        "        self.a_layout = utils.LayoutEnum.from_tensor(a)\n",
        "        self.a_layout = (\n"
        "            utils.LayoutEnum.ROW_MAJOR if getattr(self, 'tk_conv', None)\n"
        "            else utils.LayoutEnum.from_tensor(a)\n"
        "        )\n",
    ),
    (
        "        tma_atom_a, tma_tensor_a = self._make_tma_atoms_and_tensors(\n",
        "        tma_atom_a, tma_tensor_a = (\n"
        "            self._tk_im2col_a if getattr(self, 'tk_conv', None)\n"
        "            else self._make_tma_atoms_and_tensors\n"
        "        )(\n",
    ),
    (
        "            mA_mkl,\n            cute.slice_(self.tile_shape_mnk, (None, 0, None)),\n",
        "            mA_mkl,\n"
        "            (self.tile_shape_mnk[0], (self.tile_shape_mnk[2],))\n"
        "            if getattr(self, 'tk_conv', None)\n"
        "            else cute.slice_(self.tile_shape_mnk, (None, 0, None)),\n",
    ),
    (
        "        ab_stage = (\n"
        "            smem_capacity // occupancy - (mbar_helpers_bytes + epi_bytes)\n"
        "        ) // ab_bytes_per_stage\n",
        "        ab_stage = (\n"
        "            smem_capacity // occupancy - (mbar_helpers_bytes + epi_bytes)\n"
        "        ) // ab_bytes_per_stage\n"
        "        ab_stage = min(ab_stage, globals().get('TK_MAX_AB_STAGES') or ab_stage)\n",
    ),
    (
        "    @staticmethod\n    def _make_tma_atoms_and_tensors(\n",
        "    def _tk_im2col_a(self, a, smem_layout_staged, smem_tile, mcast_dim):\n"
        "        kernel, pad, stride = self.tk_conv\n"
        "        m_a = cute.make_tensor(a.iterator, cute.select(a.layout, mode=[3, 2, 1, 0, 4]))\n"
        "        m_a = cute.group_modes(m_a, begin=0, end=4)  # ((W, H, D, N), C)\n"
        "        tma_atom, tma_tensor = cute.nvgpu.cpasync.make_im2col_tma_atom(\n"
        "            cute.nvgpu.cpasync.CopyBulkTensorIm2ColG2SOp(),\n"
        "            m_a,\n"
        "            cute.slice_(smem_layout_staged, (None, None, 0)),\n"
        "            (smem_tile[0], (smem_tile[1],)),\n"
        "            lower_corner_whd=(-pad, -pad, 0),\n"
        "            upper_corner_whd=(pad - (kernel - 1), pad - (kernel - 1), 0),\n"
        "            lower_padding_whd=(pad, pad, 0),\n"
        "            upper_padding_whd=(pad, pad, 0),\n"
        "            stride_whd=(stride, stride, 1),\n"
        "            lower_srt=(0, 0, 0),\n"
        "            stride_srt=(1, 1, 1),\n"
        "        )\n"
        "        batched = cute.append(tma_tensor.layout, cute.make_layout(1))  # (M, K, L = 1)\n"
        "        return tma_atom, cute.make_tensor(tma_tensor.iterator, batched)\n\n"
        "    @staticmethod\n    def _make_tma_atoms_and_tensors(\n",
    ),
)  # fmt: skip


# Promoted FP8 sums (tiles ``...p``): Hopper's FP8 WGMMA adds its products in a format narrower
# than float32, so over a long K (a 3x3 convolution of 512 channels sums 4,608) the example's one
# accumulator drifts. With ``tk_promote`` each K step's MMAs go into a second register tile,
# zeroed first, whose sums are added into the float32 accumulator once they are complete
# (CUTLASS's promotion, at one K step); no MMA is then left in flight across steps
# (``k_pipe_mmas`` 0), and the second tile takes as many registers as the first, so the build
# allows it only where the accumulator is 64 registers a thread (a 128 x 64 tile, or 128 x 128 over
# two math warpgroups).
_PROMOTING = "                    if cutlass.const_expr(getattr(self, 'tk_promote', False)):\n"
_WAITED = "                    mainloop_pipeline.consumer_wait(mainloop_consumer_read_state)\n"
_MMAS_DONE = "                    cute.nvgpu.warpgroup.wait_group(k_pipe_mmas)\n"
# the example's main loop (the prologue's MMAs, before it, are the same text; with promotion
# the prologue has no step to run)
_MAIN_LOOP = (
    "                for k_tile in range(prologue_mma_cnt, k_tile_cnt):\n"
    "                    # Wait for TMA copies to complete\n"
    + _WAITED
    + "                    # WGMMA\n"
    "                    for k_block_idx in cutlass.range_constexpr(num_k_blocks):\n"
    "                        k_block_coord = (\n"
    "                            None,\n"
    "                            None,\n"
    "                            k_block_idx,\n"
    "                            mainloop_consumer_read_state.index,\n"
    "                        )\n"
    "                        cute.gemm(\n"
    "                            tiled_mma,\n"
    "                            accumulators,\n"
    "                            tCrA[k_block_coord],\n"
    "                            tCrB[k_block_coord],\n"
    "                            accumulators,\n"
    "                        )\n"
    "\n"
    "                    cute.nvgpu.warpgroup.commit_group()\n"
    "                    # Wait on the wgmma barrier for WGMMA to complete\n" + _MMAS_DONE
)
# the same loop making each step's sums in tk_sums (zeroed first) and adding them once complete
_PROMOTED_LOOP = (
    _MAIN_LOOP.replace("accumulators,", "tk_sums,")
    .replace(_WAITED, _WAITED + _PROMOTING + "                        tk_sums.fill(0.0)\n"
             "                        cute.nvgpu.warpgroup.fence()\n")
    .replace(_MMAS_DONE, _MMAS_DONE + _PROMOTING + "                        "
             "accumulators.store(accumulators.load() + tk_sums.load())\n")
)  # fmt: skip
_PROMOTE_PATCHES = (
    (
        "        accumulators = cute.make_rmem_tensor(acc_shape, self.acc_dtype)\n",
        "        accumulators = cute.make_rmem_tensor(acc_shape, self.acc_dtype)\n"
        "        if cutlass.const_expr(getattr(self, 'tk_promote', False)):\n"
        "            tk_sums = cute.make_rmem_tensor(acc_shape, self.acc_dtype)\n"
        "        else:\n"
        "            tk_sums = accumulators\n",
    ),
    (
        "            k_pipe_mmas = 1\n",
        "            k_pipe_mmas = 0 if getattr(self, 'tk_promote', False) else 1\n",
    ),
    (_MAIN_LOOP, _PROMOTED_LOOP),
)


def _patched_source(path: Path, out: Path, epilogue: str) -> Path:
    text = path.read_text()
    patches = [_OCCUPANCY_PATCH, *_SHAPE_PATCHES, *_CONV_PATCHES, *_PROMOTE_PATCHES]
    if epilogue in ("channel", "residual"):
        patches += _CHANNEL_PATCHES
    if epilogue == "channel":
        patches.append(_POST_SCALE_PATCH)
    if epilogue == "residual":
        patches += _RESIDUAL_PATCHES
    if epilogue in ("channel", "residual"):
        patches += _VECTOR_PATCHES
    for old, new in patches:
        if text.count(old) != 1:
            raise SystemExit(f"cutlass_gemm_build: {path} is not the example this patch fits")
        text = text.replace(old, new)
    patched = out / f"{epilogue}_epilogue_kernel.py"
    patched.write_text(text)
    return patched


# epilogue : activation : A type _ D type. scalar: op(scale * acc); channel: op(acc * col[n] +
# bias[n]), for GELU times scale; residual: op(acc * col[n] + bias[n] + z * z_scale).
KINDS = ("fp8_fp8", "fp8_f16", "f16_f16", "i8_i8", "i8_f16")  # (A's type _ D's type)
VARIANTS = (
    "scalar:relu:fp8_fp8", "scalar:relu:f16_f16", "channel:relu:fp8_fp8", "channel:none:fp8_fp8",
    "channel:gelu:fp8_fp8", "residual:relu:fp8_fp8", "channel:none:fp8_f16",
    "channel:gelu:i8_i8", "channel:none:i8_f16", "channel:gelu_tanh:fp8_fp8",
    "channel:gelu_tanh:i8_i8", "channel:relu:i8_i8", "channel:none:i8_i8",
    "residual:relu:i8_i8", "residual:relu:fp8_f16", "residual:relu:i8_f16",
)  # fmt: skip
# geometry:epilogue:activation:kind of the implicit-GEMM convolutions (``--convs``): a 3x3 window
# padded by 1 of stride 1 or 2 with ReLU (a ResNet bottleneck's middle layer), a 1x1 of stride 2
# (a stage's shortcut, where the GEMM tactics first copy every other pixel) with none, or with
# the block's residual and ReLU (where a quantized engine adds the block's other branch)
CONVS = (
    "3x3s1:channel:relu:fp8_fp8", "3x3s2:channel:relu:fp8_fp8", "1x1s2:channel:none:fp8_fp8",
    "1x1s2:residual:relu:fp8_fp8",
    "3x3s1:channel:relu:i8_i8", "3x3s2:channel:relu:i8_i8", "1x1s2:channel:none:i8_i8",
    "1x1s2:residual:relu:i8_i8",
)  # fmt: skip
# their tiles: 64-byte K steps (k2) for 64 input channels (a K step stays within one tap);
# w2: two math warpgroups of 64 rows each
CONV_TILES = ("128x64k2", "128x64o2k2", "128x128", "128x128o2", "128x256", "128x128k2", "128x128w2")
CONV_MAX_STAGES = 8
# the E4M3 variants' (GEMMs' and convolutions') tiles with promoted sums
PROMOTE_TILES = ("128x64p", "128x128w2p")
# tiles with the vectors staged in shared memory, for the variants of a quantized ResNet's
# memory-bound layers (8-bit output, ReLU or none) and every convolution
VECTOR_TILES = ("128x64o2v", "128x128o2v", "128x256v", "128x128o2c1x2v", "128x128c1x2w2v",
                "128x64o2k2v")  # fmt: skip
CONV_VECTOR_TILES = ("128x64o2k2v", "128x128o2v", "128x256v")
# tiles with two residual buffers, for the residual variants only (GEMMs and convolutions; the
# convolutions leave out the clusters)
# (not 128x128o2 at 128-byte K steps: the second buffer leaves it one main-loop stage, and the
# build leaves out every kernel of one stage)
RESIDUAL_TILES = ("128x64o2k2vd", "128x128o2k2vd", "128x64o2vd", "128x128vd", "128x256vd",
                  "128x128c1x2w2vd")  # fmt: skip
TILES = (
    "128x64", "128x128", "128x256", "64x128", "64x256", "128x64o2", "128x128o2", "64x128o2",
    "128x256k2", "128x64o2k2", "128x128o2k2", "64x256k2", "128x256e128x64", "128x128o2e64x128",
    "64x256e64x128", "128x128o2c1x2", "128x128c1x2w2",
)  # fmt: skip


def _tile(spec: str) -> tuple:
    found = re.fullmatch(
        r"(64|128)x(64|128|256)(?:o([12]))?(?:k([124]))?(?:e(\d+)x(\d+))?(?:s(2|4|8|16))?"
        r"(?:c([12])x([12]))?(w2)?(p)?(v)?(d)?",
        spec,
    )
    if found is None:
        raise SystemExit(
            f"cutlass_gemm_build: tile {spec!r} is not MxN[oO][kK][eMxN][sS][cMxN][w2][p][v][d] "
            "(M 64/128, N 64/128/256)"
        )
    epi = (int(found.group(5)), int(found.group(6))) if found.group(5) else None
    tile_m, tile_n = int(found.group(1)), int(found.group(2))
    warpgroups = 2 if found.group(10) or (tile_m > 64 and tile_n > 128) else 1
    if found.group(11) and tile_m * tile_n // (128 * warpgroups) > 64:
        raise SystemExit(
            f"cutlass_gemm_build: tile {spec!r}: promoted sums take a second accumulator, which "
            "fits where the first is 64 registers a thread (128x64, 64x128, 128x128w2)"
        )
    return (
        int(found.group(1)),
        int(found.group(2)),
        int(found.group(3) or 1),
        int(found.group(4) or 4),
        epi,
        int(found.group(7) or 4),
        (int(found.group(8) or 1), int(found.group(9) or 1)),
        2 if found.group(10) else 0,  # math warpgroups: 0, the example's choice
        bool(found.group(11)),  # FP8 sums promoted into float32 every K step
        bool(found.group(12)),  # the epilogue's vectors staged in shared memory
        bool(found.group(13)),  # two residual buffers (residual kernels only)
    )


def _with_promoted(tiles: str, promoted: str, kind: str, staged: str = "") -> list[str]:
    """A variant's tiles: ``tiles``, and for E4M3 operands the promoted ones too (int8 sums are
    exact, so theirs are not built), then ``staged`` (the tiles with staged vectors)."""
    names = [t for t in tiles.split(",") if t]
    if kind.startswith("fp8"):
        names += [t for t in promoted.split(",") if t]
    return names + [t for t in staged.split(",") if t]


def _conv(geometry: str) -> tuple[int, int, int]:
    """(kernel, pad, stride) of a convolution geometry ``KxKsS``: a square window padded by half
    of it, 3x3 or 1x1, stride 1 or 2."""
    found = re.fullmatch(r"([13])x\1s([12])", geometry)
    if found is None:
        raise SystemExit(f"cutlass_gemm_build: conv geometry {geometry!r} is not 3x3s1, 3x3s2, "
                         "1x1s1 or 1x1s2")  # fmt: skip
    kernel = int(found.group(1))
    return kernel, kernel // 2, int(found.group(2))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernel", type=Path, required=True, help="CUTLASS's Hopper FP8 GEMM example")
    p.add_argument("--out", type=Path, default=ROOT / "build" / "cutlass_gemm")
    p.add_argument("--tiles", default=",".join(TILES),
                   help="CTA tiles, M x N (M 64 or 128; N 64, 128 or 256), then o2: two CTAs "
                        "an SM, k2: 64-byte K stages, eMxN: the epilogue subtile, s8: epilogue "
                        "stages, c2x1: a cluster of 2 x 1 CTAs (TMA multicast)")  # fmt: skip
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help="epilogue:activation:kind (A type _ D type), each built at every tile")  # fmt: skip
    p.add_argument("--convs", default=",".join(CONVS),
                   help="implicit-GEMM convolutions, geometry:epilogue:activation:kind (geometry "
                        "KxKsS: 3x3s1, 3x3s2, 1x1s2; '' for none)")  # fmt: skip
    p.add_argument("--conv-tiles", default=",".join(CONV_TILES), help="the convolutions' tiles")
    p.add_argument("--promote-tiles", default=",".join(PROMOTE_TILES),
                   help="tiles built with promoted sums (p), for the E4M3 variants only")  # fmt: skip
    p.add_argument("--vector-tiles", default=",".join(VECTOR_TILES),
                   help="tiles built with the epilogue's vectors staged in shared memory (v), "
                        "for the 8-bit ReLU or none GEMM variants")  # fmt: skip
    p.add_argument("--conv-vector-tiles", default=",".join(CONV_VECTOR_TILES),
                   help="the same for the convolutions")  # fmt: skip
    p.add_argument("--residual-tiles", default=",".join(RESIDUAL_TILES),
                   help="tiles built for the residual variants only, typically with two "
                        "residual buffers (d)")  # fmt: skip
    p.add_argument("--sms", type=int, default=132, help="persistent CTAs (the GPU's SM count)")
    args = p.parse_args(argv)

    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    import cutlass
    import cutlass.cute as cute
    from cutlass import pipeline
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    source = args.kernel.resolve()
    modules = {
        epilogue: _load_kernel_module(_patched_source(source, out, epilogue))
        for epilogue in ("scalar", "channel", "residual")
    }
    dtypes = {"fp8": cutlass.Float8E4M3FN, "f16": cutlass.Float16, "i8": cutlass.Int8}

    def relu(v):
        return cute.where(v > 0.0, v, cute.full_like(v, 0.0))

    def none(v):
        return v

    def gelu_erf(v):  # (ONNX's Gelu and BERT's, through erf: made the GEMM up to 2x slower)
        half, one = cute.full_like(v, 0.5), cute.full_like(v, 1.0)
        return half * v * (one + cute.erf(v * cute.full_like(v, 0.7071067811865476)))

    def gelu_tanh(v):  # (tanh's form, on the hardware's tanh: within 2e-3 of erf's GELU)
        inner = v * (
            cute.full_like(v, 0.7978845608028654) + cute.full_like(v, 0.035677408136300125) * v * v
        )
        half = cute.full_like(v, 0.5)
        return half * v + half * v * cute.math.tanh(inner, fastmath=True)

    # gelu: the example's clipped odd polynomial for the normal CDF (a few FMAs an element)
    activations = {"relu": relu, "none": none, "gelu_erf": gelu_erf, "gelu": None,
                   "gelu_tanh": gelu_tanh}  # fmt: skip
    for stale in out.glob("*.o"):
        stale.unlink()
    manifest = {"kernels": []}
    m = cute.sym_int32(divisibility=128)
    n, k = cute.sym_int32(divisibility=16), cute.sym_int32(divisibility=16)
    images, height, width = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
    channels = cute.sym_int32(divisibility=16)
    variants = []
    for variant in args.convs.split(",") if args.convs else ():
        geometry, rest = variant.split(":", 1)
        conv = _conv(geometry)
        epilogue, act, kind = rest.split(":")
        if (
            epilogue not in ("channel", "residual")
            or act not in activations
            or kind not in ("fp8_fp8", "i8_i8")
        ):
            raise SystemExit(f"cutlass_gemm_build: no conv variant {variant!r}")
        tiles = _with_promoted(args.conv_tiles, args.promote_tiles, kind, args.conv_vector_tiles)
        if epilogue == "residual":
            tiles += [t for t in args.residual_tiles.split(",") if t and _tile(t)[6] == (1, 1)]
        for tile in tiles:
            shape = _tile(tile)
            if shape[6] != (1, 1):
                raise SystemExit(f"cutlass_gemm_build: conv tile {tile!r} has a cluster")
            variants.append((epilogue, act, kind, shape, (geometry, conv)))
    for variant in args.variants.split(",") if args.variants else ():
        epilogue, act, kind = variant.split(":")
        if epilogue not in modules or act not in activations or kind not in KINDS:
            raise SystemExit(f"cutlass_gemm_build: no variant {variant!r}")
        # (the residual epilogue's tile is of the operands' 8-bit type, its output of that type
        # or float16; a per-channel epilogue writes 16 bits from E4M3 operands, fp8_f16)
        wrong = {"residual": kind == "f16_f16", "channel": kind == "f16_f16",
                 "scalar": kind.startswith("i8")}  # fmt: skip
        if wrong.get(epilogue, False):
            raise SystemExit(f"cutlass_gemm_build: no variant {variant!r}")
        memory_bound = (
            epilogue != "scalar" and act in ("relu", "none") and kind in ("fp8_fp8", "i8_i8")
        )  # (a quantized ResNet's 1x1 layers)
        tiles = _with_promoted(args.tiles, args.promote_tiles, kind,
                               args.vector_tiles if memory_bound else "")  # fmt: skip
        if epilogue == "residual" and memory_bound:  # (their staged vectors: 8-bit outputs)
            tiles += [t for t in args.residual_tiles.split(",") if t]
        variants += [(epilogue, act, kind, _tile(tile), None) for tile in tiles]
    for epilogue, act, kind, shape, conv in variants:
        (tile_m, tile_n, occupancy, k_steps, epi_tile, stages, cluster, warpgroups, promote,
         staged, double) = shape  # fmt: skip
        a_name, c_name = kind.split("_")
        ex = modules[epilogue]
        tag = (
            f"{tile_m}x{tile_n}o{occupancy}k{k_steps}"
            + (f"e{epi_tile[0]}x{epi_tile[1]}" if epi_tile else "")
            + (f"s{stages}" if stages != 4 else "")
            + (f"c{cluster[0]}x{cluster[1]}" if cluster != (1, 1) else "")
            + ("w2" if warpgroups else "")
            + ("p" if promote else "")
            + ("v" if staged else "")
            + ("d" if double else "")
        )
        if double and epilogue != "residual":
            raise SystemExit(f"cutlass_gemm_build: tile {tag}: only residual kernels take ...d")
        name = f"gemm_{kind}_{epilogue}_{act}_{tag}"
        t0 = time.perf_counter()
        a = make_fake_compact_tensor(
            dtypes[a_name], (m, k, 1), stride_order=(1, 0, 2), assumed_align=16
        )
        if conv is not None:  # (A: the NHWC input as (N, D = 1, H, W, C), read through im2col)
            name = f"conv{conv[0]}_{kind}_{epilogue}_{act}_{tag}"
            a = make_fake_compact_tensor(
                dtypes[a_name],
                (images, 1, height, width, channels),
                stride_order=(4, 3, 2, 1, 0),
                assumed_align=16,
            )
        b = make_fake_compact_tensor(
            dtypes[a_name], (n, k, 1), stride_order=(1, 0, 2), assumed_align=16
        )
        c = make_fake_compact_tensor(
            dtypes[c_name], (m, n, 1), stride_order=(1, 0, 2), assumed_align=16
        )
        acc = cutlass.Int32 if a_name == "i8" else cutlass.Float32  # (int8: exact int32 sums)
        gemm = ex.HopperFP8GeluPersistentGemmKernel(acc, (tile_m, tile_n), cluster, 1, True)
        gemm.k_steps, gemm.epi_tile = k_steps, epi_tile
        gemm.tk_conv = conv[1] if conv is not None else None
        gemm.tk_promote = promote
        gemm.tk_vec_smem = staged
        if staged and epilogue == "scalar":
            raise SystemExit(f"cutlass_gemm_build: {name}: the scalar epilogue has no vectors")
        if staged:  # (the two rows of N floats, out of the main loop's stages)
            gemm.smem_capacity -= (8 * tile_n + 128) * occupancy
        ex.TK_MAX_AB_STAGES = CONV_MAX_STAGES if conv is not None else None
        if warpgroups == 2 and tile_m == 128:  # (two math warpgroups of 64 rows each, as the
            # example picks for N > 128 only: the derived counts and the epilogue's barrier)
            gemm.atom_layout_mnk = (2, 1, 1)
            gemm.num_mma_warp_groups = 2
            gemm.threads_per_cta = 3 * gemm.num_threads_per_warp_group
            gemm.num_mma_threads = 2 * gemm.num_threads_per_warp_group
            gemm.epilog_sync_barrier = pipeline.NamedBarrier(
                barrier_id=1, num_threads=gemm.num_mma_threads
            )
        ex.TK_EPI_STAGES = stages
        if epilogue == "residual":  # (the residual's tiles, out of the main loop's stages)
            gemm.smem_capacity -= ((1 + double) * tile_m * (tile_n + 16) + 1024) * occupancy
            gemm.tk_res_double = gemm.tk_groups_ahead = double
            gemm.tk_res_dtype = dtypes[a_name]
        if occupancy == 2:
            gemm.occupancy = 2
            gemm.mma_register_requirement = 216
        extra = ()
        if epilogue != "scalar":
            extra = tuple(
                make_fake_compact_tensor(cutlass.Float32, (n,), assumed_align=16) for _ in range(2)
            )
        if epilogue == "residual":
            extra += (
                make_fake_compact_tensor(  # (the residual: the operands' type)
                    dtypes[a_name], (m, n, 1), stride_order=(1, 0, 2), assumed_align=16
                ),
            )
        # the scalar scales the sums (scalar), the GELU's result (channel) or the residual
        post_scale = epilogue == "channel" and act.startswith("gelu")
        try:
            fn = cute.compile(
                gemm, a, b, c, *extra, 1.0, epilogue == "scalar" or post_scale,
                args.sms * occupancy // (cluster[0] * cluster[1]),
                make_fake_stream(), activations[act] or ex.poly11_gelu,
                options="--gpu-arch sm_90a",
            )  # fmt: skip
        except ValueError as exc:  # (no main-loop stage beside a wide output's epilogue)
            if "strictly positive" not in str(exc):
                raise
            print(f"{name}: left out: no main-loop stage beside the epilogue's shared memory")
            continue
        if gemm.ab_stage < 2:  # (the example's main loop waits for a second K tile before it
            # releases the first: with one stage that is a deadlock wherever K spans more than
            # one, as 128x128o2k4s8 and an e64x128 variant stalled the GPU in earlier rounds)
            print(f"{name}: left out: one main-loop stage beside the epilogue's shared memory")
            continue
        fn.export_to_c(str(out), name)
        entry, tensors = _header_entry((out / f"{name}.h").read_text())
        manifest["kernels"].append(
            {"name": name, "a": a_name, "c": c_name, "tile": [tile_m, tile_n], "occupancy": occupancy, "tag": tag,
             "k_steps": k_steps, "epi_tile": epi_tile, "epi_stages": stages, "entry": entry,
             "tensors": tensors, "epilogue": epilogue, "activation": act, "post_scale": post_scale,
             "cluster": list(cluster), "warpgroups": warpgroups or None, "promote": promote,
             "vectors_in_smem": staged, "ab_stages": gemm.ab_stage,
             **({"residual_buffers": 1 + double} if epilogue == "residual" else {}),
             # (the object code's digest: a timing cache's key, so a rebuilt kernel is retimed)
             "sha256": hashlib.sha256((out / f"{name}.o").read_bytes()).hexdigest(),
             **({"conv": list(conv[1])} if conv is not None else {})}
        )  # fmt: skip
        print(
            f"{name}: compiled in {time.perf_counter() - t0:.1f} s ({gemm.ab_stage} main-loop "
            f"stages, {gemm.epi_stage} epilogue stages)",
            flush=True,
        )

    runtime = Path(cutlass.__file__).resolve().parents[2] / "cu13" / "lib"
    static = runtime / "libcuda_dialect_runtime_static.a"
    if not static.is_file():
        raise SystemExit(f"cutlass_gemm_build: the DSL's runtime shim is not at {static}")
    lib = out / "libtk_cutlass_gemm.so"
    cmd = ["g++", "-shared", "-o", str(lib), *sorted(str(o) for o in out.glob("*.o")), str(static)]
    subprocess.run(cmd, check=True)
    manifest["library"] = lib.name
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"wrote {lib} ({lib.stat().st_size // 1024} KiB) and manifest.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
