# SPDX-License-Identifier: Apache-2.0
"""ttnn 0.81.1's speculative primitives measured on the mock device, not adopted by the backend (issue 37): whether
the real ttnn accepts them at the shapes a verify step of Llama-3.1-8B would give them, and what they would change.
`make tt-mock` prints the lines; a refusal is a finding, not a failure.

- paged_scaled_dot_product_attention_decode(..., spec_multi_pos_tiles=T) (a keyword of the wheel's binding, not in its
  docstring): T candidate rows of one user in one batch row (Q [1, users, 32 T, head_dim], DRAM interleaved, each
  candidate's heads a tile of rows; cur_pos one non-decreasing group of T positions per user), the user's K/V
  scanned once up to the group's last position and each candidate masked to its own (reader_decode_all.cpp and
  writer_decode_all.cpp in the wheel: spec_multi_pos). The backend's verify step scans each row's K/V apart.
- experimental.indexed_fused_update_cache(cache_k, k, cache_v, v, physical_update_idxs_tensor): K and V rows packed
  [1, kv heads, rows, head_dim] written to physical cache rows (page x rows per page + row), "serializes all rows
  owned by a head/width worker, so multiple rows may safely target the same physical page" (its docstring): one op
  for both caches where the backend's ordered passes issue 2 per pass. BFLOAT16 caches only.
"""
import torch
import ttnn

from models.tt_transformers.ttnn_backend.model import VALUE_BYTES

HEAD_DIM, LAYERS, USERS, ROWS, CONTEXT = 128, 32, 8, 5, 4096  # Llama-3.1-8B; 8 users verifying 4 drafts at 4k


def _outcome(call) -> str:
    """"accepted", or "refused: " and the condition the op's validation stopped on."""
    try:
        call()
    except RuntimeError as e:
        return "refused: " + str(e).strip().splitlines()[0].rsplit(": ", 1)[-1]
    return "accepted"


def measure(mesh) -> list[str]:
    replicated = ttnn.ReplicateTensorToMesh(mesh)

    def tile(shape, dtype=ttnn.bfloat16):
        return ttnn.from_torch(torch.zeros(shape), dtype=dtype, layout=ttnn.TILE_LAYOUT, device=mesh,
                               memory_config=ttnn.DRAM_MEMORY_CONFIG, mesh_mapper=replicated)

    def ints(t):
        return ttnn.from_torch(t.int(), dtype=ttnn.int32, device=mesh, memory_config=ttnn.DRAM_MEMORY_CONFIG,
                               mesh_mapper=replicated)
    program = ttnn.SDPAProgramConfig(compute_with_storage_grid_size=(8, 8), exp_approx_mode=False, q_chunk_size=256,
                                     k_chunk_size=256)
    lines, blocks = [], 32
    page_table = ints(torch.arange(1, USERS * blocks + 1).view(USERS, blocks))
    positions = ints(torch.tensor([CONTEXT - ROWS + j for _ in range(USERS) for j in range(ROWS)]))
    # per device: T3K's (32 / 8 q heads, 8 / 8 KV heads) and N150's (32, 8)
    for mesh_name, q_heads, kv_heads in (("T3K", 4, 1), ("N150", 32, 8)):
        cache = [tile((USERS * blocks + 1, kv_heads, 32, HEAD_DIM), ttnn.bfloat8_b) for _ in range(2)]
        outcome = _outcome(lambda: ttnn.transformer.paged_scaled_dot_product_attention_decode(
            tile((1, USERS, 32 * ROWS, HEAD_DIM)), *cache, page_table_tensor=page_table, cur_pos_tensor=positions,
            scale=HEAD_DIM ** -0.5, program_config=program, memory_config=ttnn.DRAM_MEMORY_CONFIG,
            spec_multi_pos_tiles=ROWS))
        per_position = LAYERS * 2 * kv_heads * HEAD_DIM * VALUE_BYTES["bfloat8_b"]  # K and V bytes, a device's
        lines.append(f"spec_multi_pos_tiles={ROWS}, {mesh_name}'s per-device heads ({q_heads} q, {kv_heads} KV), a "
                     f"bfloat8_b cache: {outcome}; K/V read per verify step of {USERS} users x {ROWS} rows at "
                     f"{CONTEXT} positions, all layers, a device: {USERS * ROWS * CONTEXT * per_position / 1e9:.2f} GB "
                     f"row by row, {USERS * CONTEXT * per_position / 1e9:.2f} GB a scan per user")
    rows = USERS * ROWS
    for dtype in (ttnn.bfloat16, ttnn.bfloat8_b):
        caches = [tile((rows + 1, 8, 32, HEAD_DIM), dtype) for _ in range(2)]
        physical = ints(torch.tensor([[32 + r for r in range(rows)]]))  # page 1 onwards, row by row
        outcome = _outcome(lambda: ttnn.experimental.indexed_fused_update_cache(
            caches[0], tile((1, 8, rows, HEAD_DIM)), caches[1], tile((1, 8, rows, HEAD_DIM)), physical))
        lines.append(f"indexed_fused_update_cache, {rows} rows, 8 KV heads, a {dtype} cache: {outcome}; "
                     f"{LAYERS} ops a step where the ordered passes issue {LAYERS * 2 * ROWS} (2 x {ROWS} passes x "
                     f"{LAYERS} layers), before the reshapes its packed input needs")
    return lines
