# SPDX-License-Identifier: Apache-2.0
"""How the device draft head's ops run: their compute-kernel configs, and each matmul over the 32-row decode tile
DRAM-sharded as TT-Transformers' decode matmuls are (with a prefill-shaped program for the prompt fill)."""
import math
from dataclasses import dataclass
from typing import Any, Optional

from .model import TILE_ROWS
from .ttnn_api import ttnn

FILL_ROWS = 256  # a prompt's rows per prefill-shaped cache fill: 8 cache blocks (blocks_per_user is a multiple of 8)


@dataclass
class HeadKernelConfigs:
    """The compute-kernel and SDPA configs the head's ops run with (without them each op takes its defaults, SDPA
    decode an approximate exp). TT's own decode: RMSNorm in HiFi2 with fp32 accumulation
    (models/common/rmsnorm.py), SDPA decode in HiFi2 with exp_approx_mode False (tt/model_config.py,
    SDPA_DECODE_PROGCFG and sdpa_decode_compute_kernel_cfg: chunks of 256 over the compute grid). The matmuls in HiFi2
    with fp32 accumulation, as TT's decode runs its DRAM-sharded matmuls (tt/attention.py forward_decode: "Use HiFi2
    for DRAM-sharded matmuls as they are otherwise flop-bound. Loses 1 bit of activation precision"): HiFi2 multiplies
    the whole weight by the activation less its last mantissa bit (tt-llk's fidelity phases), half the matmul passes
    of HiFi4 (tt-metal's tech_reports/matrix_engine), and tools/head_precision.py found the drafts no worse for it
    (docs/ttnn_backend.md, the head's precision). Accepted by ttnn 0.81.1 at both shapes on the mock device (make
    tt-mock); their effect on the drafts only hardware can measure."""

    norm: Any
    matmul: Any
    sdpa: Any
    sdpa_program: Any

    @classmethod
    def for_mesh(cls, mesh) -> "HeadKernelConfigs":
        def kernel(fidelity, fp32):
            return ttnn.WormholeComputeKernelConfig(math_fidelity=fidelity, math_approx_mode=False,
                                                    fp32_dest_acc_en=fp32, packer_l1_acc=fp32)
        grid = mesh.compute_with_storage_grid_size()
        return cls(norm=kernel(ttnn.MathFidelity.HiFi2, True), matmul=kernel(ttnn.MathFidelity.HiFi2, True),
                   sdpa=kernel(ttnn.MathFidelity.HiFi2, False),
                   sdpa_program=ttnn.SDPAProgramConfig(compute_with_storage_grid_size=grid, q_chunk_size=256,
                                                       k_chunk_size=256, exp_approx_mode=False))


@dataclass
class DecodeMatmul:
    """How one column chunk of one of the head's matmuls runs over the 32-row decode tile, as TT-Transformers' decode
    matmuls (tt/model_config.py): the weight width-sharded over the DRAM banks (create_dram_sharded_mem_config: N
    padded to a multiple of 32 x banks, the last bank's shard holding the padding), the activation width-sharded in L1
    over a grid that divides K (dram_shard_core_grid_for_k, find_grid), and
    MatmulMultiCoreReuseMultiCastDRAMShardedProgramConfig (dram_matmul_config): each bank's reader streams its own
    columns once, the output width-sharded in L1. A wide matmul is cut into chunks (column_chunks), as TT cuts its
    LM head (tt/lm_head.py: max_columns_per_device)."""

    columns: tuple[int, int]  # the chunk's output columns
    weight_config: Any
    input_config: Any  # None where the input comes sharded already (wo: nlp_concat_heads_decode's, a head per core)
    program: Any
    fill: Any = None  # the prompt fill's program (fill_program), for the matmuls a fill runs (fc, qkv)

    @classmethod
    def build(cls, mesh, k: int, columns: tuple[int, int], input_cores: Optional[int] = None) -> "DecodeMatmul":
        banks, tile, n = mesh.dram_grid_size(), TILE_ROWS, columns[1] - columns[0]
        padded = math.ceil(n / (tile * banks.x)) * tile * banks.x
        weight_config = ttnn.MemoryConfig(ttnn.TensorMemoryLayout.WIDTH_SHARDED, ttnn.BufferType.DRAM, ttnn.ShardSpec(
            ttnn.CoreRangeSet({ttnn.CoreRange(ttnn.CoreCoord(0, 0), ttnn.CoreCoord(banks.x - 1, banks.y - 1))}),
            (k, padded // banks.x), ttnn.ShardOrientation.ROW_MAJOR))
        input_config = None
        if input_cores is None:
            rows, cols = find_grid(k // tile, mesh.compute_with_storage_grid_size())
            input_cores = rows * cols
            input_config = ttnn.create_sharded_memory_config(
                (tile, k // input_cores), ttnn.CoreGrid(y=rows, x=cols), ttnn.ShardStrategy.WIDTH,
                ttnn.ShardOrientation.ROW_MAJOR, use_height_and_width_as_shard_shape=True)
        program = ttnn.MatmulMultiCoreReuseMultiCastDRAMShardedProgramConfig(
            in0_block_w=largest_divisor(k // (tile * input_cores), MAX_IN0_BLOCK_W), per_core_M=1,
            per_core_N=math.ceil(n / (tile * input_cores)), fused_activation=None)
        return cls(columns, weight_config, input_config, program)

    def add_fill_program(self, mesh, k: int) -> None:
        """The same matmul over a prompt fill's FILL_ROWS rows: TT's prefill config over the DRAM-sharded weight
        (ModelArgs.matmul_config: MatmulMultiCoreReuseMultiCastProgramConfig over the compute grid, in0_block_w and
        out_subblock_w divisors up to 4, which fp32 accumulation's 4-tile destination holds; the automatic config
        picks a program that wants the weight interleaved: "Input B memory layout must be INTERLEAVED", ttnn 0.81.1
        on the mock device)."""
        grid, tile = mesh.compute_with_storage_grid_size(), TILE_ROWS
        per_core_n = math.ceil((self.columns[1] - self.columns[0]) / (tile * grid.x))
        self.fill = ttnn.MatmulMultiCoreReuseMultiCastProgramConfig(
            compute_with_storage_grid_size=grid, in0_block_w=largest_divisor(k // tile, 4), out_subblock_h=1,
            out_subblock_w=largest_divisor(per_core_n, 4), per_core_M=math.ceil(FILL_ROWS / (tile * grid.y)),
            per_core_N=per_core_n, transpose_mcast=False, fused_activation=None, fuse_batch=False)


# The L1 budget of a DRAM-sharded matmul (matmul_multicore_reuse_mcast_dram_sharded_program_factory.cpp): per worker
# its in1 buffer holds 3 x in0_block_w x N / banks weight tiles and its fp32 partials N / banks tiles of 4 KB; an
# LM head of 49,152 columns (1,536 tiles, 128 per bank) with in0_block_w 8 would need over 1.3 MB of a core's 1.5 MB
# (it clashed with the L1 buffers on the mock device). So chunks of at most 32 tiles per bank and in0_block_w <= 2:
# under 0.5 MB a worker.
MAX_TILES_PER_BANK = 32
MAX_IN0_BLOCK_W = 2


def column_chunks(n: int, banks: int) -> list[tuple[int, int]]:
    """A matmul's output columns in equal tile-aligned chunks of at most MAX_TILES_PER_BANK tiles per DRAM bank."""
    count = math.ceil(n / (banks * MAX_TILES_PER_BANK * TILE_ROWS))
    width = math.ceil(n / count / TILE_ROWS) * TILE_ROWS
    return [(start, min(n, start + width)) for start in range(0, n, width)]


def find_grid(tiles: int, grid) -> tuple[int, int]:
    """TT's ModelArgs.find_grid (tt/model_config.py): (rows, cols), each at most 8 and within the compute grid, of
    a core count that divides `tiles`, the count closest to 32 first."""
    for cores in sorted((c for c in range(1, 65) if tiles % c == 0), key=lambda c: abs(c - 32)):
        for rows in range(1, min(8, grid.y) + 1):
            if cores % rows == 0 and cores // rows <= min(8, grid.x):
                return rows, cores // rows
    raise ValueError(f"no core grid divides {tiles} tiles")  # unreachable: one core divides anything


def largest_divisor(n: int, limit: int = 8) -> int:
    """TT's ModelArgs.find_largest_divisor: in0_block_w, the largest divisor of n up to 8."""
    return next(d for d in range(limit, 0, -1) if n % d == 0)
