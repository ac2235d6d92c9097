# SPDX-License-Identifier: Apache-2.0
"""The stand-in's ttnn ops (tests/tt_stand_in/ttnn.py, a TEST DOUBLE) refuse what ttnn 0.81.1 refuses, and their
traced forms replay: cheap checks of the rules the device draft head depends on."""
import pytest
import torch

from ..tt_stand_in import ttnn as t


@pytest.fixture
def mesh(monkeypatch):
    monkeypatch.setattr(t, "FABRIC", {"config": t.FabricConfig.DISABLED, "open_meshes": 0})
    return t.open_mesh_device(t.MeshShape(1, 1), trace_region_size=10**9)


def dev(x, mesh, dtype=t.bfloat16, layout=t.TILE_LAYOUT, mem=None):
    return t.from_torch(x, dtype=dtype, layout=layout, device=mesh, memory_config=mem)


def test_as_tensor_cache_file(mesh, tmp_path):
    w = torch.randn(64, 32)
    with pytest.raises(RuntimeError, match="memory_config must be specified when device is specified"):
        t.as_tensor(w, t.bfloat16, device=mesh)
    kwargs = dict(layout=t.TILE_LAYOUT, device=mesh, memory_config=t.DRAM_MEMORY_CONFIG,
                  mesh_mapper=t.ReplicateTensorToMesh(mesh), cache_file_name=tmp_path / "w")
    first = t.as_tensor(w, t.bfloat16, **kwargs)
    assert (tmp_path / "w_dtype_BFLOAT16_layout_TILE.tensorbin").is_file()
    again = t.as_tensor(torch.zeros(64, 32), t.bfloat16, **kwargs)  # read from the file, not from the argument
    assert torch.equal(t.to_torch(again), t.to_torch(first)) and again.layout == t.TILE_LAYOUT


def test_refusals(mesh):
    x = dev(torch.randn(1, 1, 32, 64), mesh)
    with pytest.raises(RuntimeError, match="The width of the first tensor must be equal to the height"):
        t.linear(x, dev(torch.randn(32, 16), mesh))
    with pytest.raises(RuntimeError, match="Inputs to matmul must be tilized"):
        t.linear(x, dev(torch.randn(64, 16), mesh, layout=t.ROW_MAJOR_LAYOUT))
    with pytest.raises(RuntimeError, match="Gamma's last padded dim needs to equal tile width"):
        t.rms_norm(x, weight=dev(torch.ones(1, 1, 1, 64), mesh, layout=t.ROW_MAJOR_LAYOUT))
    assert t.rms_norm(x, weight=dev(torch.ones(1, 1, 2, 32), mesh, layout=t.ROW_MAJOR_LAYOUT)).shape == x.shape
    with pytest.raises(RuntimeError, match="optional output tensor currently unsupported!"):
        t.concat([x, x], dim=3, output_tensor=dev(torch.zeros(1, 1, 32, 128), mesh))
    with pytest.raises(RuntimeError, match="All Tensors should have same dtypes."):
        t.concat([x, dev(torch.randn(1, 1, 32, 64), mesh, dtype=t.float32)], dim=3)
    with pytest.raises(RuntimeError, match="Weights tensor must have BFLOAT16 dtype"):
        t.embedding(dev(torch.zeros(1, 32), mesh, t.uint32, t.ROW_MAJOR_LAYOUT),
                    dev(torch.randn(100, 64), mesh, t.float32, t.ROW_MAJOR_LAYOUT))
    with pytest.raises(RuntimeError, match="Invalid arguments to reshape"):
        t.reshape(x, [1, 32, 3, 64])
    with pytest.raises(RuntimeError, match="Inputs to softmax must be tilized"):
        t.softmax(dev(torch.randn(1, 1, 32, 64), mesh, layout=t.ROW_MAJOR_LAYOUT))


def test_cache_update_and_sdpa_decode_operands(mesh):
    """paged_update_cache wants its update height-sharded, one user per core; SDPA decode takes q in DRAM but not in
    float32."""
    cache = dev(torch.zeros(64, 1, 32, 32), mesh, dtype=t.bfloat8_b)
    table = dev(torch.arange(64).view(32, 2), mesh, t.int32, t.ROW_MAJOR_LAYOUT, t.DRAM_MEMORY_CONFIG)
    pos = dev(torch.arange(32), mesh, t.int32, t.ROW_MAJOR_LAYOUT, t.DRAM_MEMORY_CONFIG)
    update = dev(torch.randn(1, 32, 1, 32), mesh)
    with pytest.raises(RuntimeError, match="Expect input_tensor to be sharded"):
        t.experimental.paged_update_cache(cache, update, update_idxs_tensor=pos, page_table=table)
    sharded = t.create_sharded_memory_config((32, 32), t.CoreGrid(y=4, x=8), t.ShardStrategy.HEIGHT,
                                             use_height_and_width_as_shard_shape=True)
    t.experimental.paged_update_cache(cache, t.to_memory_config(update, sharded), update_idxs_tensor=pos,
                                      page_table=table)
    # row 5, position 5: block table[5, 0] = 10, packed as the cache's dtype stores it
    assert torch.equal(cache.data[10, :, 5], t.stored(update.data[0, 5], cache.dtype))
    q = dev(torch.randn(1, 32, 4, 32), mesh, mem=t.DRAM_MEMORY_CONFIG)
    out = t.transformer.paged_scaled_dot_product_attention_decode(q, cache, cache, page_table_tensor=table,
                                                                  cur_pos_tensor=pos)
    assert out.shape == q.shape and out.mem == t.DRAM_MEMORY_CONFIG
    with pytest.raises(RuntimeError, match="Unsupported data type FLOAT32."):
        t.transformer.paged_scaled_dot_product_attention_decode(
            dev(torch.randn(1, 32, 4, 32), mesh, dtype=t.float32), cache, cache, page_table_tensor=table,
            cur_pos_tensor=pos)


def test_copy_into_a_persistent_tensor_replays(mesh):
    """ttnn.copy writes a persistent tensor inside a trace; an intermediate deallocated during capture stays
    readable by the replays."""
    src = dev(torch.zeros(1, 1, 32, 64), mesh)
    dst = dev(torch.zeros(1, 1, 32, 128), mesh)

    def program():
        mid = t.concat([src, src], dim=3)
        t.copy(t.mul(mid, mid), dst)
        t.deallocate(mid)
    program()  # compiles
    trace = t.begin_trace_capture(mesh)
    program()
    t.end_trace_capture(mesh, trace)
    t.copy_host_to_device_tensor(t.from_torch(torch.full((1, 1, 32, 64), 3.0), dtype=t.bfloat16,
                                              layout=t.TILE_LAYOUT), src)
    t.execute_trace(mesh, trace)
    assert torch.equal(t.to_torch(dst), torch.full((1, 1, 32, 128), 9.0))


def test_rules_taken_from_the_code_they_cite(mesh):
    """Issue 30's review finding 6: where the stand-in differed from the tt-metal code it cites, it follows the code:
    prefill padding (tt/common.py get_padded_prefill_len at 622c6fb9: 128, else 1,024, else the next power of
    two), top k over fewer than 64 columns (padded to 64 by the host wrapper, with float's smallest positive value:
    negative logits lose to the padding), and TT_CCL's semaphores handed out in turn per axis slot."""
    from ..tt_stand_in import tt_transformers as tt

    assert [tt.get_padded_prefill_len(n) for n in (5, 128, 200, 1500, 3000, 5000, 9000)] == \
        [128, 128, 1024, 2048, 4096, 8192, 16384]
    values, ids = t.topk(dev(torch.full((1, 1, 32, 40), -1.0), mesh), k=2)
    assert (t.to_torch(ids).int() >= 40).all() and (t.to_torch(values) > 0).all()  # the padded columns win
    ccl = tt.TT_CCL(mesh)
    first, second, third = (ccl.get_and_cycle_ag_semaphore_handles() for _ in range(3))
    assert first is not second and first is third  # double-buffered
    assert ccl.get_and_cycle_ag_semaphore_handles(1) is not first  # axis 1 has a slot of its own
    assert ccl.get_and_cycle_ag_semaphore_handles(0) is second  # axis 0 shares the no-axis slot (`not 0`)


def test_bfloat8_b_is_stored_as_the_device_stores_it(mesh):
    """Issue 31, finding 1: weights, caches and op outputs in bfloat8_b hold what ttnn's host conversion gives
    (bfp8.py, checked against the wheel by make tt-mock), not float32; the wheel refuses bfloat8_b in row-major."""
    from models.tt_transformers.ttnn_backend.bfp8 import bfp8_round

    w = torch.randn(64, 96)
    stored = t.to_torch(dev(w, mesh, dtype=t.bfloat8_b))
    assert torch.equal(stored, bfp8_round(w)) and not torch.equal(stored, w)
    x = dev(torch.randn(1, 1, 32, 64), mesh)
    out = t.to_torch(t.linear(x, dev(w, mesh), dtype=t.bfloat8_b))
    assert torch.equal(out, bfp8_round(out)) and out.isfinite().all()
    with pytest.raises(RuntimeError, match="Layout must be Layout::TILE for bfloat8_b"):
        t.from_torch(w, dtype=t.bfloat8_b, layout=t.ROW_MAJOR_LAYOUT)


def test_tt_attention_head_ops_refuse_what_tt_metal_refuses(mesh):
    """The TT head ops the device draft head runs (issue 31, finding 4 and 7), with the checks their device operations
    make: nlp_create_qkv_heads_decode takes no bfloat8_b and puts each user's heads on its own core;
    rotary_embedding_llama wants cos, sin and the rotation matrix on the input's cores in decode and rotates each
    pair (x0, x1) to (x0 cos - x1 sin, x1 cos + x0 sin); nlp_concat_heads_decode wants height-sharded heads;
    paged_fill_cache copies tiles without converting (dtypes equal) into the page-table slice's blocks."""
    from models.tt_transformers.ttnn_backend.eagle3_head import rotation_matrix

    H, Hk, D = 4, 2, 32
    per_user = t.create_sharded_memory_config((32, D), t.CoreGrid(y=4, x=8), t.ShardStrategy.HEIGHT,
                                              use_height_and_width_as_shard_shape=True)
    qkv = torch.randn(1, 1, 32, (H + 2 * Hk) * D)
    with pytest.raises(RuntimeError, match="Unsupported data format"):
        t.experimental.nlp_create_qkv_heads_decode(dev(qkv, mesh, dtype=t.bfloat8_b), num_heads=H, num_kv_heads=Hk,
                                                   memory_config=per_user)
    q, k, v = t.experimental.nlp_create_qkv_heads_decode(dev(qkv, mesh), num_heads=H, num_kv_heads=Hk,
                                                         memory_config=per_user)
    assert (q.shape, k.shape, q.mem) == ((1, 32, H, D), (1, 32, Hk, D), per_user)
    assert torch.equal(t.to_torch(v)[0, 3], qkv[0, 0, 3, (H + Hk) * D :].view(Hk, D))
    angle = torch.rand(32, 1, D // 2)
    cos, sin = (torch.stack((f(angle), f(angle)), dim=-1).flatten(-2).view(1, 32, 1, D) for f in (torch.cos, torch.sin))
    cos_d, sin_d = (t.interleaved_to_sharded(dev(c, mesh), per_user) for c in (cos, sin))
    mat = dev(rotation_matrix().repeat(1, 1, 32, 1), mesh, mem=t.create_sharded_memory_config(
        (32, 32), t.CoreGrid(y=4, x=8), t.ShardStrategy.HEIGHT, use_height_and_width_as_shard_shape=True))
    rotated = t.to_torch(t.experimental.rotary_embedding_llama(q, cos_d, sin_d, mat, is_decode_mode=True))
    x = t.to_torch(q)
    assert torch.allclose(rotated[..., 0::2], x[..., 0::2] * cos[..., 0::2] - x[..., 1::2] * sin[..., 0::2])
    assert torch.allclose(rotated[..., 1::2], x[..., 1::2] * cos[..., 1::2] + x[..., 0::2] * sin[..., 1::2])
    elsewhere = t.create_sharded_memory_config((32, D), t.CoreGrid(y=2, x=8), t.ShardStrategy.HEIGHT,
                                               use_height_and_width_as_shard_shape=True)
    with pytest.raises(RuntimeError, match="on the input's cores"):
        t.experimental.rotary_embedding_llama(q, t.to_memory_config(cos_d, elsewhere), t.to_memory_config(
            sin_d, elsewhere), mat, is_decode_mode=True)
    with pytest.raises(RuntimeError, match="Input tensor must be sharded"):
        t.experimental.nlp_concat_heads_decode(dev(torch.randn(1, 32, H, D), mesh), num_heads=H)
    joined = t.experimental.nlp_concat_heads_decode(q, num_heads=H)
    assert joined.shape == (1, 1, 32, H * D) and joined.mem.memory_layout == t.ShardStrategy.WIDTH
    cache = dev(torch.zeros(16, Hk, 32, D), mesh, dtype=t.bfloat8_b)
    table = dev(torch.tensor([[7, 3]]), mesh, t.int32, t.ROW_MAJOR_LAYOUT, t.DRAM_MEMORY_CONFIG)
    rows = dev(torch.randn(1, Hk, 64, D), mesh)
    with pytest.raises(RuntimeError, match="must match the cache's"):
        t.experimental.paged_fill_cache(cache, rows, table, batch_idx=0)
    t.experimental.paged_fill_cache(cache, t.typecast(rows, t.bfloat8_b), table, batch_idx=0)
    assert torch.equal(cache.data[3, :, 5], t.stored(rows.data[0, :, 37], t.bfloat8_b))  # row 37: block 1 -> 3


@pytest.mark.parametrize("heads, kv_heads, tiles", [(9, 3, 4), (4, 1, 8), (8, 2, 2)])
def test_grouped_attention_is_the_per_row_attention(mesh, monkeypatch, heads, kv_heads, tiles):
    """attention.grouped_attention (one spec_multi_pos_tiles call over each user's cache, KV heads folded into
    groups) gives every row exactly what TT's per-row paged SDPA decode gives it: each row sees the positions up to its
    own, in its own user's blocks; a group's rows past its user's repeat the last position; idle groups are skipped.
    The stand-in's op refuses what the wheel refuses for the mode (several KV heads, a sharded Q, an unsorted
    group)."""
    from models.tt_transformers.ttnn_backend import attention
    from ..tt_stand_in import install

    install(monkeypatch)
    dim, blocks, users = 64, 3, 32 // tiles
    torch.manual_seed(0)
    cache_k, cache_v = (torch.randn(users * blocks + 1, kv_heads, 32, dim).bfloat16().float() for _ in range(2))
    k, v = (dev(c, mesh, t.bfloat8_b) for c in (cache_k, cache_v))
    owned = torch.arange(users * blocks, dtype=torch.int32).view(users, blocks) + 1
    positions = torch.full((32,), -1)
    starts = [40, 63, 5][: users - 1]  # the last user slot idle
    for g, start in enumerate(starts):
        n = min(tiles, 3 + g)  # the group's rows, the rest repeating its last position
        positions[g * tiles: (g + 1) * tiles] = torch.tensor([start + min(j, n - 1) for j in range(tiles)])
    q_rows = torch.randn(1, 32, heads, dim).bfloat16()
    sharded = t.MemoryConfig(t.ShardStrategy.HEIGHT, "L1", ((32, dim), 32, t.ShardOrientation.ROW_MAJOR))
    q = t.to_memory_config(dev(q_rows, mesh), sharded)
    int_rows = dict(dtype=t.int32, layout=t.ROW_MAJOR_LAYOUT, mem=t.DRAM_MEMORY_CONFIG)
    table = owned.repeat_interleave(tiles, dim=0)
    kwargs = dict(scale=dim ** -0.5, memory_config=t.DRAM_MEMORY_CONFIG)
    per_row = t.transformer.paged_scaled_dot_product_attention_decode(
        q, k, v, page_table_tensor=dev(table, mesh, **int_rows), cur_pos_tensor=dev(positions, mesh, **int_rows),
        **kwargs)
    group_table = torch.cat([owned * kv_heads + h for h in range(kv_heads)])
    head = torch.arange(tiles * 32).view(1, 1, -1, 1) % 32
    masks = [dev(((head >= h * heads // kv_heads) & (head < (h + 1) * heads // kv_heads))
                 .expand(1, users, tiles * 32, dim).float(), mesh) for h in range(kv_heads)] if kv_heads > 1 else []
    group = attention.GroupedRows(tiles, dev(group_table, mesh, **int_rows),
                                  dev(positions.repeat(kv_heads), mesh, **int_rows), masks)
    op = t.transformer.paged_scaled_dot_product_attention_decode
    grouped = attention.grouped_attention(op, group)(q, k, v, page_table_tensor=None, cur_pos_tensor=None, **kwargs)
    assert grouped.shape == per_row.shape == q_rows.shape
    active = positions != -1
    assert torch.equal(t.to_torch(grouped)[0, active], t.to_torch(per_row)[0, active])
    assert not t.to_torch(grouped)[0, ~active].any()  # the idle group: skipped
    one_head = (len(cache_k) * kv_heads, 1, 32, dim)
    shape = (1, users, tiles * 32, dim)
    stacked = t.concat([t.reshape(t.to_memory_config(q, t.DRAM_MEMORY_CONFIG), shape, shape)] * kv_heads, dim=1)
    call = dict(page_table_tensor=group.page_table, cur_pos_tensor=group.positions, spec_multi_pos_tiles=tiles)
    if kv_heads > 1:
        with pytest.raises(RuntimeError, match=f"requires num_kv_heads == 1, got {kv_heads}"):
            op(stacked, k, v, **call)
    with pytest.raises(RuntimeError, match="requires an unsharded"):
        op(t.to_memory_config(stacked, t.MemoryConfig(t.ShardStrategy.HEIGHT, "L1", ((32, dim), 32, "R"))),
           t.reshape(k, one_head), t.reshape(v, one_head), **call)
    backwards = positions.flip(0).repeat(kv_heads)
    with pytest.raises(RuntimeError, match="must be non-decreasing"):
        op(stacked, t.reshape(k, one_head), t.reshape(v, one_head), page_table_tensor=group.page_table,
           cur_pos_tensor=dev(backwards, mesh, **int_rows), spec_multi_pos_tiles=tiles)


def test_group_sizes_follow_the_ops_limits():
    """attention.group_tiles: the power of two at or above the rows, where the wheel's spec_multi_pos_tiles accepts
    it on a Wormhole under TT's SDPA decode config (checked on the mock N150): T <= 8 (L1), users x T <= 32 (the tile),
    KV heads x 32 / T <= 64 (a core per group); per row (1) elsewhere."""
    from models.tt_transformers.ttnn_backend.attention import group_tiles

    assert [group_tiles(p, 1, 3) for p in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 1]  # 16 overflows L1
    assert group_tiles(5, 4, 8) == 8 and group_tiles(5, 5, 8) == 1  # 5 users of 8 rows: past the tile
    assert group_tiles(2, 4, 8) == 1 and group_tiles(3, 4, 8) == 4  # 8 KV heads x 16 groups: past 64 cores
