# SPDX-License-Identifier: Apache-2.0
"""The ttnn backend held to the rules of tt-metal's own code, on the stand-in (tests/tt_stand_in: a TEST DOUBLE
whose every rule names the tt-metal file and function it mirrors; it is not a device and proves nothing about one).
Each test names the review finding it covers (issue 21); each failed on the backend before that review's fixes. The
findings about the demo's runs on the backend: tests/demo/test_ttnn.py."""
import weakref

import pytest
import torch

from models.tt_transformers.speculative.generator import SpeculativeGenerator
from models.tt_transformers.speculative.backend import UserRows
from models.tt_transformers.speculative.drafters import SuffixDrafter
from models.tt_transformers.checkpoints.checkpoint import resolve_checkpoint
from models.tt_transformers.ttnn_backend import device as tt_device
from models.tt_transformers.ttnn_backend import taps as tt_taps
from models.tt_transformers.errors import UserError
from models.tt_transformers.ttnn_backend.causal_lm import TtnnCausalLM
from models.tt_transformers.ttnn_backend.model import build_tt_model, weight_cache_root
from models.tt_transformers.ttnn_backend.trace_plan import TraceKey, model_trace_bytes, trace_keys, trace_ops

from ..conftest import cache_holding_the_embedded_conversion, save_tiny_hf_checkpoint
from ..stand_in_backend import STAND_IN_TRACE_REGION, mesh_traces
from ..tt_stand_in import install
from ..tt_stand_in import tt_transformers as stand_in_tt
from ..tt_stand_in import ttnn as stand_in_ttnn


@pytest.fixture
def stand_in(monkeypatch, tmp_path):
    """The stand-in installed, a clean fabric state, a Tenstorrent device 'present' and our cache in tmp_path."""
    install(monkeypatch)
    monkeypatch.setattr(stand_in_ttnn, "FABRIC", {"config": stand_in_ttnn.FabricConfig.DISABLED, "open_meshes": 0})
    monkeypatch.setattr(tt_device, "tt_device_present", lambda: True)
    cache_holding_the_embedded_conversion(monkeypatch, tmp_path / "cache")
    return monkeypatch


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A small Llama checkpoint whose heads split over 2 devices and whose 120-token vocabulary TT pads to 128 on
    two devices (so device 1's share ends in 8 padded columns)."""
    folder = tmp_path_factory.mktemp("tiny") / "Tiny-1B-Instruct"
    save_tiny_hf_checkpoint(folder, vocab_size=120, initializer_range=0.5)
    return resolve_checkpoint(str(folder))


def build(mesh, ckpt, users=1, max_seq_len=192, tap_gather="device", **kwargs):
    return TtnnCausalLM(build_tt_model(mesh, ckpt.folder, ckpt.name, users, max_seq_len, True, **kwargs), users,
                        max_seq_len, mesh_traces=mesh_traces(mesh), tap_gather=tap_gather)


def mesh_of(shape):
    return stand_in_ttnn.open_mesh_device(stand_in_ttnn.MeshShape(*shape), trace_region_size=STAND_IN_TRACE_REGION)


def plain(lm, prompts, n):
    return [r.output_tokens for r in SpeculativeGenerator(lm, None, 0).generate(prompts, n)]


def test_attention_subclass_finds_tt_weights(stand_in, embedded_checkpoint):
    """Finding 1: TT-Transformers' Attention looks its weights up under get_state_dict_prefix(class name), whose map
    knows "Attention" and not a subclass's own name; the weight cache is named from that prefix."""
    lm = build(mesh_of((1, 1)), embedded_checkpoint)
    assert type(lm.tt.model.layers[0].attention).__name__ == "Attention"
    assert (lm.tt.args.weight_cache_path(stand_in_ttnn.bfloat8_b) / "layers.29.attention.wqkv").is_file()
    with pytest.raises(KeyError):  # what a subclass of another name meets in TT's own __init__
        lm.tt.args.get_state_dict_prefix("OrderedKVWriteAttention", 0)


@pytest.mark.parametrize("name,shape", [("N150", (1, 1)), ("N300", (1, 2)), ("T3K", (1, 8))])
def test_fabric_for_meshes_of_several_devices(stand_in, name, shape, tiny):
    """Finding 2: a mesh of several devices opens with the fabric set (TT-Transformers' CCL ops need it) and resets
    it after closing; one device opens without (the fabric needs two chips). Decode runs there."""
    stand_in.setenv("MESH_DEVICE", name)
    with tt_device.open_mesh(trace_region_size=STAND_IN_TRACE_REGION) as mesh:
        assert mesh.shape == shape
        assert (mesh.fabric != stand_in_ttnn.FabricConfig.DISABLED) == (shape != (1, 1))
        if shape[1] <= 2:
            lm = build(mesh, tiny)
            assert SpeculativeGenerator(lm, SuffixDrafter(1), 4).generate([[1, 2, 3, 1, 2, 3]], 8)
    assert stand_in_ttnn.get_fabric_config() == stand_in_ttnn.FabricConfig.DISABLED


def test_fabric_choice_and_tt_style_device_params(stand_in):
    """The fabric tt-metal's device_params picks per cluster (a 6U Galaxy a ring, a Blackhole Galaxy a 2-D torus), and
    device_params written as tt-metal's demos write them ({"fabric_config": True, "trace_region_size": ...,
    "num_command_queues": 1}) open the mesh."""
    clusters = stand_in_ttnn.ClusterType
    for cluster, fabric in ((clusters.T3K, "FABRIC_1D"), (clusters.GALAXY, "FABRIC_1D_RING"),
                            (clusters.BLACKHOLE_GALAXY, "FABRIC_2D_TORUS_XY")):
        stand_in.setattr(stand_in_ttnn.cluster, "get_cluster_type", lambda cluster=cluster: cluster)
        assert tt_device.fabric_config_for((1, 8)) == getattr(stand_in_ttnn.FabricConfig, fabric)
    assert tt_device.fabric_config_for((1, 1)) is None
    stand_in.setattr(stand_in_ttnn.cluster, "get_cluster_type", lambda: clusters.N300)
    stand_in.setenv("MESH_DEVICE", "N300")
    with tt_device.open_mesh(**{"fabric_config": True, "trace_region_size": 30_000_000, "num_command_queues": 1}) as m:
        assert m.fabric == stand_in_ttnn.FabricConfig.FABRIC_1D and m.trace_region_size == 30_000_000


def test_ccl_without_fabric_is_refused(stand_in, tiny):
    """The stand-in's side of finding 2: a mesh of two devices opened without the fabric cannot decode."""
    lm = build(mesh_of((1, 2)), tiny)
    with pytest.raises(RuntimeError, match="un-initialized fabric context"):
        lm.step([UserRows(0, [1], 0)])


def test_split_vocabulary_argmax_and_top_k_per_device(stand_in, tiny):
    """Finding 10: on a two-device mesh each device reduces its own vocabulary share (the padded columns of the
    last one masked) and the host merges 32 ids and maxima per device; the logits are never all-gathered. Ids, top k
    and speculative output equal one device's."""
    prompt = [[5, 9, 17, 5, 9, 17, 5, 9]]
    one_device = mesh_of((1, 1))
    reference = build(one_device, tiny).step([UserRows(0, prompt[0], 0)], logits=True, top_k=4)
    reference_output = plain(build(one_device, tiny), prompt, 12)
    stand_in_ttnn.close_mesh_device(one_device)  # the fabric cannot change while a mesh is open
    stand_in.setenv("MESH_DEVICE", "N300")
    with tt_device.open_mesh(trace_region_size=STAND_IN_TRACE_REGION) as mesh:
        two = build(mesh, tiny)
        assert two.vocab.split and two.vocab.share == 64 and two.tt.args.padded_vocab_size == 128
        out = two.step([UserRows(0, prompt[0], 0)], logits=True, top_k=4)
        assert out.ids == reference.ids and out.top_ids == reference.top_ids
        assert torch.equal(out.logits[0], reference.logits[0])
        gathered = {key for key in mesh.compiled if key[0] == "all_gather_async"}
        # the norms' inputs only (each device's [1, 1, 32, dim / 2]: shapes are per device, as ttnn's): never the logits
        assert gathered == {("all_gather_async", ((1, 1, 32, 32),))}
        assert plain(build(mesh, tiny), prompt, 12) == reference_output
        spec = SpeculativeGenerator(build(mesh, tiny), SuffixDrafter(1, recycle=4), 4).generate(prompt, 12)
        assert [r.output_tokens for r in spec] == reference_output


@pytest.mark.parametrize("tap_gather", ["device", "host"])
def test_taps_and_the_device_head_on_a_two_device_mesh_equal_one_devices(stand_in, tiny, tmp_path, tap_gather):
    """The residual stream entering a decoder layer is split over the devices along dim (tt/decoder.py: "x is
    fractured across devices and interleaved in DRAM (for prefill) and sharded in L1 (for decode)"; tt/embedding.py
    splits the embedding's columns): a prefill's taps are read back concatenated in device order, a step's are
    all-gathered into the tap tile (whole rows on every device), and the head, replicated, drafts what it drafts on one
    device. Issue 37 point 7: with --tap_gather host the step's copies are read back and written into the tile by the
    host instead, the same states, with no collective of ours in the traced step."""
    from models.tt_transformers.speculative.drafters.eagle3_device import HeadFeed
    from models.tt_transformers.checkpoints.safetensors_index import read_embedding
    from models.tt_transformers.checkpoints.model_shape import ModelShape
    from models.tt_transformers.ttnn_backend.eagle3_head import TtnnDraftHead

    from ..conftest import random_head_tensors

    prompt, rows, taps = [5, 9, 17, 5, 9, 17, 5, 9], [UserRows(0, [3, 7, 11], 8)], (1, 0, 3)
    args = ModelShape.from_hf_config(tiny.config)
    # a 32-wide head_dim (the tiny target's is 16): TT's rotary_embedding_llama rotates whole tiles
    config, weights = random_head_tensors(args, seed=1, taps=taps, n_heads=2, n_kv_heads=2, head_dim=32)

    gathers = []
    tt_all_gather = stand_in_tt.tt_all_gather
    stand_in.setattr(stand_in_tt, "tt_all_gather", lambda *a, **k: gathers.append(1) or tt_all_gather(*a, **k))

    def run(mesh):
        lm = build(mesh, tiny, tap_gather=tap_gather)
        lm.warm_up(3, 0, taps)
        head = TtnnDraftHead(lm, config, weights, read_embedding(tiny), 2, args, cache_dir=tmp_path / str(id(mesh)))
        head.warm_up()
        states = lm.prefill(0, prompt, taps=taps).hidden[0]
        drafted = head.draft([HeadFeed(0, 0, prompt[1:] + [3], states=states)], [0], 2)
        lm.step(rows, taps=taps)
        return lm, states, lm.read_taps(taps)[:3], drafted

    one_device = mesh_of((1, 1))
    _, *reference = run(one_device)
    stand_in_ttnn.close_mesh_device(one_device)  # the fabric cannot change while a mesh is open
    stand_in.setenv("MESH_DEVICE", "N300")
    with tt_device.open_mesh(trace_region_size=STAND_IN_TRACE_REGION) as mesh:
        lm, *out = run(mesh)
        assert out[0].shape == (8, 3 * lm.tt.args.dim)
        assert torch.equal(out[0], reference[0]) and torch.equal(out[1], reference[1])
        assert out[2] == reference[2]
        assert lm.tap_tile(taps).shards == 1  # gathered: every device holds whole rows
        assert bool(gathers) == (tap_gather == "device")  # tt_all_gather in the traced step, or none at all


def test_decode_residual_layout_and_the_tap_copy(stand_in, tiny):
    """Issue 24, the stand-in's side: TT's decoder asserts its input is in the residual memory config (width-sharded
    in L1 in decode, ModelArgs.get_residual_mem_config), and ttnn.clone refuses a sharded input with an interleaved
    output (clone_device_operation.cpp), so the tapped copy goes to DRAM through to_memory_config; cloning would
    fail where the real op fails. A Galaxy's taps are refused in one line."""
    lm = build(mesh_of((1, 1)), tiny)
    residual = lm.tt.args.get_residual_mem_config(stand_in_tt.Mode.DECODE)
    assert residual.is_sharded() and residual.buffer_type == "L1"
    x = stand_in_ttnn.from_torch(torch.zeros(1, 1, 32, 64), dtype=stand_in_ttnn.bfloat16, device=lm.tt.mesh_device)
    with pytest.raises(AssertionError, match="decoder input memcfg mismatch"):
        lm.tt.model.layers[0](x, None)
    with pytest.raises(RuntimeError, match="mixed sharded/interleaved layout not currently supported"):
        stand_in_ttnn.clone(stand_in_ttnn.to_memory_config(x, residual), memory_config=stand_in_ttnn.DRAM_MEMORY_CONFIG)
    assert stand_in_ttnn.to_memory_config(x, stand_in_ttnn.DRAM_MEMORY_CONFIG) is x  # no copy when it is there already
    stand_in.setattr(tt_taps, "dram_copy",
                     lambda t: stand_in_ttnn.clone(t, memory_config=stand_in_ttnn.DRAM_MEMORY_CONFIG))
    with pytest.raises(RuntimeError, match="mixed sharded/interleaved"):
        lm.step([UserRows(0, [1, 2], 0)], taps=(1,))
    stand_in.setattr(lm.tt.args, "is_galaxy", True)
    with pytest.raises(ValueError, match="taps on a Galaxy"):
        lm.step([UserRows(0, [1], 0)], taps=(0,))


def test_trace_plan_with_taps():
    """Traces are keyed by (write passes, top k, taps, logits); a tapped one adds a DRAM copy and a slice per tap and
    the stack, gather, concat and copy into the tap tile to the op count; a device head's traces are counted beside the
    target's."""
    from models.tt_transformers.ttnn_backend.trace_plan import head_region_bytes

    taps = (2, 15, 27)
    assert trace_keys(5, 4, taps) == sorted({(p, 4, taps, False) for p in (1, 2, 4, 5)} | {(1, 0, (), False)})
    assert trace_keys(5, 0, ()) == [(1, 0, (), False), (2, 0, (), False), (4, 0, (), False), (5, 0, (), False)]
    assert trace_ops(30, TraceKey(1, 0, taps, False), 49152) - trace_ops(30, TraceKey(1, 0, (), False), 49152) == 10
    plain = model_trace_bytes("Llama-3.1-8B", ["N150"], 1, 32, 32, 128256, 5, 0, ())
    tapped = model_trace_bytes("Llama-3.1-8B", ["N150"], 1, 32, 32, 128256, 5, 0, (2, 16, 29))
    assert len(tapped) == len(plain) + 1 and sum(tapped) > sum(plain)  # the plain step beside the tapped ones
    head = head_region_bytes("Llama-3.1-8B", ["N150"], 32, 4)
    assert len(head) == 8 and sum(head) < sum(plain) / 2  # eight one-layer traces: less than half the target's four


def test_model_name_and_weight_cache_from_the_real_name(stand_in, tmp_path, embedded_checkpoint, tiny):
    """Findings 3, 13 and 14: ModelArgs takes model_name from HF_MODEL's last component (and the path AutoConfig
    records); a hub snapshot (named by its hash) and a converted GGUF (folder "hf") still give the model's name, each
    checkpoint gets a weight-cache folder of its own, and nothing is written inside the checkpoint."""
    hub = tmp_path / "hub"
    snapshot = hub / "models--tiny-org--Tiny-1B-Instruct" / "snapshots" / "0123abcd"
    snapshot.parent.mkdir(parents=True)
    snapshot.symlink_to(tiny.folder, target_is_directory=True)
    stand_in.setenv("HF_HUB_CACHE", str(hub))
    hub_ckpt = resolve_checkpoint("tiny-org/Tiny-1B-Instruct")
    mesh = mesh_of((1, 1))
    before = sorted(p.name for p in tiny.folder.iterdir())
    for ckpt, name in ((embedded_checkpoint, "SmolLM2-135M-Instruct"), (hub_ckpt, "Tiny-1B-Instruct"),
                       (tiny, "Tiny-1B-Instruct")):
        args = build(mesh, ckpt).tt.args
        assert args.model_name == name and args.model_cache_path.parent.name.startswith(f"{name}-")
        assert args.model_cache_path.is_relative_to(tmp_path / "cache")
    assert sorted(p.name for p in tiny.folder.iterdir()) == before
    other = tmp_path / "other" / "hf"
    save_tiny_hf_checkpoint(other, vocab_size=120)
    assert weight_cache_root(other, "hf") != weight_cache_root(tmp_path / "another" / "hf", "hf")


def test_buffers_allocated_under_a_live_trace_on_the_stand_in(stand_in, tiny):
    """The stand-in's side of the trace-allocation rule (allocator.cpp verify_safe_allocation, ttnn 0.81.1): a buffer
    allocated while a trace is live gets a warning (once) and is overwritten when that trace replays; the backend
    makes the mesh's traces anew (all released, all allocated and compiled, then all captured) when a model on it
    needs another, so nothing of its own is ever allocated under a live trace."""
    mesh = mesh_of((1, 1))
    first = build(mesh, tiny)
    first.step([UserRows(0, [1], 0)])
    with pytest.warns(RuntimeWarning, match="unsafe due to the existence of an active trace"):
        held = stand_in_ttnn.from_torch(torch.zeros(4), device=mesh)  # allocated under first's live trace
    first.step([UserRows(0, [1], 0)])
    assert held.data.isnan().all()  # overwritten by the replay
    stand_in_ttnn.deallocate(held)
    second = build(mesh, tiny)  # its weights and cache are allocated under first's traces too
    second.step([UserRows(0, [1, 2], 0)])  # remakes every trace on the mesh: safe again
    assert first.step([UserRows(0, [1], 0)]).ids and mesh.unsafe == []


def test_trace_region_overflow_on_the_stand_in(stand_in, tiny):
    """The stand-in's side of finding 6: traces past the region fail as tt-metal's do; no region and allocations in
    the capture fail too. Issue 37's third review (first-try risk: a region from an op-count estimate): tt-metal's
    refusal comes back as one line naming the --trace_region_size to pass, scaled from what the device reported for
    the traces captured so far, and a mesh opened with that size runs the same steps."""
    import re

    lm = build(stand_in_ttnn.open_mesh_device(stand_in_ttnn.MeshShape(1, 1), trace_region_size=100_000), tiny)
    lm.warm_up(3, 0, ())
    with pytest.raises(ValueError, match="outgrew the trace region: .* rerun with --trace_region_size [0-9]+ ") as e:
        lm.prepare_traces()
    assert "\n" not in str(e.value) and "allocated for trace region" in str(e.value.__cause__)
    size = int(re.search(r"--trace_region_size ([0-9]+)", str(e.value)).group(1))
    lm.release()
    lm = build(stand_in_ttnn.open_mesh_device(stand_in_ttnn.MeshShape(1, 1), trace_region_size=size), tiny)
    lm.warm_up(3, 0, ())
    lm.prepare_traces()
    assert len(lm.traces) == 3 and lm.step([UserRows(0, [1, 2, 3], 0)]).ids
    lm = build(stand_in_ttnn.open_mesh_device(stand_in_ttnn.MeshShape(1, 1)), tiny)
    with pytest.raises(RuntimeError, match="non-zero trace_region_size"):
        lm.step([UserRows(0, [1], 0)])


def test_top_k_on_multi_core_widths_with_unsigned_ids(stand_in, embedded_checkpoint, prompts_for_top_k):
    """Finding 8: the 49,152-token vocabulary's top k runs on power-of-two slices (never the single-core program),
    and ids >= 32,768 (uint16 indices) come back as themselves."""
    lm = build(mesh_of((1, 1)), embedded_checkpoint)
    lm.prefill(0, prompts_for_top_k)
    out = lm.step([UserRows(0, prompts_for_top_k[-3:], len(prompts_for_top_k) - 3)], logits=True, top_k=8)
    assert lm.tt.mesh_device.single_core_topk == 0
    logits = out.logits[0]
    ids = torch.tensor(out.top_ids[0])
    assert torch.equal(logits.gather(1, ids), logits.topk(8, dim=-1).values)  # the 8 best (ties in either order)
    assert all(len(set(row)) == 8 for row in out.top_ids[0])
    assert any(i >= 32768 for row in out.top_ids[0] for i in row)


@pytest.fixture
def prompts_for_top_k(embedded_tokenizer):
    """Text whose next tokens include ids above 32,768 among the top 8 (checked by the test)."""
    return embedded_tokenizer("Die Gesellschaft für Naturkunde veröffentlicht jährlich Berichte über").input_ids


def test_max_seq_len_need_not_be_a_power_of_two(stand_in, embedded_checkpoint):
    """Finding 11: TT's first prefill runs its warm-up, which asserts min(max_prefill_chunk_size, max_seq_len) is a
    power of two; ModelArgs gets the next one (2048 for 1280) and prefill works."""
    lm = build(mesh_of((1, 1)), embedded_checkpoint, max_seq_len=1280)
    assert lm.tt.args.max_seq_len == 2048 and lm.max_seq_len == 1280
    assert lm.prefill(0, [1, 2, 3]).ids


def test_mesh_names_follow_tt_metal(stand_in):
    """Finding 15: every MESH_DEVICE name tt-metal maps, and all devices in one row when it is unset."""
    assert tt_device.mesh_shape("N150x4") == (1, 4) and tt_device.mesh_shape("P150x8") == (1, 8)
    assert tt_device.mesh_shape("P100") == (1, 1) and tt_device.mesh_shape("BHGLX") == (8, 4)
    stand_in.delenv("MESH_DEVICE", raising=False)
    assert tt_device.mesh_shape() == (1, stand_in_ttnn.AVAILABLE_DEVICES)
    with pytest.raises(ValueError, match="MESH_DEVICE='N151'"):
        tt_device.mesh_shape("N151")


def test_blackhole_device_params_and_the_system_mesh(stand_in):
    """Issue 30's review finding 5: device params as tt-metal's get_updated_device_params makes them (one
    DispatchCoreConfig; on Blackhole ROW dispatch only with both a fabric and a tensix config, else COL; the tensix
    config the caller's, else DISABLED, passed to set_fabric_config), and with MESH_DEVICE unset the system mesh's own
    shape (open_mesh_device without one: 8 x 4 on a Galaxy)."""
    fabric_calls, opened = [], []
    set_fabric, open_device = stand_in_ttnn.set_fabric_config, stand_in_ttnn.open_mesh_device
    stand_in.setattr(stand_in_ttnn, "set_fabric_config", lambda *a, **k: fabric_calls.append(a) or set_fabric(*a, **k))
    stand_in.setattr(stand_in_ttnn, "open_mesh_device", lambda **k: opened.append(k) or open_device(**k))
    row, col, mux = stand_in_ttnn.DispatchCoreAxis.ROW, stand_in_ttnn.DispatchCoreAxis.COL, \
        stand_in_ttnn.FabricTensixConfig.MUX

    def open_and_close(**params):
        with tt_device.open_mesh(trace_region_size=10**6, **params):
            pass
        return opened[-1]["dispatch_core_config"]
    stand_in.setattr(stand_in_ttnn, "ARCH", {"name": "blackhole"})
    stand_in.setenv("MESH_DEVICE", "P300")
    assert open_and_close(dispatch_core_axis=row).axis == col  # a fabric but no tensix config
    assert fabric_calls[-2] == (stand_in_ttnn.FabricConfig.FABRIC_1D, stand_in_ttnn.FabricReliabilityMode.STRICT_INIT,
                                None, stand_in_ttnn.FabricTensixConfig.DISABLED)  # (the last: reset after closing)
    config = open_and_close(dispatch_core_axis=row, fabric_tensix_config=mux)
    assert (config.axis, config.fabric_tensix_config, fabric_calls[-2][-1]) == (row, mux, mux)
    stand_in.setenv("MESH_DEVICE", "P150")
    assert open_and_close(dispatch_core_axis=row, fabric_tensix_config=mux).axis == col  # no fabric on one chip
    stand_in.setattr(stand_in_ttnn, "ARCH", {"name": "wormhole_b0"})
    stand_in.setenv("MESH_DEVICE", "N150")
    config = open_and_close()
    assert (config.type, config.axis, config.fabric_tensix_config) == (None, None, None)
    assert opened[-1]["mesh_shape"] == (1, 1)
    stand_in.delenv("MESH_DEVICE")
    open_and_close()
    assert opened[-1]["mesh_shape"] is None  # the system mesh, whatever its shape


def test_a_sampled_step_reads_only_the_rows_in_use(stand_in, tiny):
    """Issue 30's review finding 3: a sampled step's logits come back for the rows in use (the smallest traced slice
    of 4, 8 or 16 rows holding them), not 32 rows x the vocabulary (~8 MB a step for Llama-3.1-8B); the same values."""
    mesh = mesh_of((1, 1))
    lm = build(mesh, tiny)
    full = lm.step([UserRows(0, [1, 2, 3, 4, 5, 6], 0)], logits=True).logits[0]
    reads, to_torch = [], stand_in_ttnn.to_torch
    stand_in.setattr(stand_in_ttnn, "to_torch", lambda t, *a, **k: reads.append(tuple(t.shape)) or to_torch(t, *a, **k))
    for rows, read in ((3, 4), (6, 8), (12, 16), (20, 32)):
        reads.clear()
        out = lm.step([UserRows(0, list(range(1, rows + 1)), 0)], logits=True)
        assert [shape[-2] for shape in reads if shape[-1] > 1] == [read], rows  # one read of the logits
        assert out.logits[0].shape[0] == rows and torch.equal(out.logits[0][:6], full[: min(rows, 6)])


def long_prompt(n: int) -> list[int]:
    return [(7 * i) % 120 for i in range(n)]


def test_a_chunked_prompt_leaves_every_other_users_cache_alone(stand_in, tiny):
    """Issue 37 point 2: TT's chunked prefill pads the user's page table with zeros to the padded prompt's blocks and
    fills the cache through it, and paged_fill_cache skips only -1 entries, so a long prompt's padding K/V land in
    physical block 0. With block 0 a user's first 32 positions, user 0's cache was overwritten by user 1's prefill
    (plain and speculative runs alike: the lossless checks stayed green); block 0 is a sink now. (Chunks of 2,048
    rows for this model, as TT's table gives larger models on N150.)"""
    stand_in.setitem(stand_in_tt.MAX_PREFILL_CHUNK_SIZES_DIV1024, "Tiny-1B", {"N150": 2})
    lm = build(mesh_of((1, 1)), tiny, users=2, max_seq_len=2240)
    lm.prefill(0, long_prompt(40))
    before = lm.step([UserRows(0, [9], 40)], logits=True).logits[0]
    lm.prefill(1, long_prompt(2100))  # padded to 4,096: its second chunk's pages are 2 of the user's and 62 zeros
    assert any(name == "chunked_sdpa@2048" for name, _ in lm.tt.mesh_device.compiled)  # it did run in chunks
    after = lm.step([UserRows(0, [9], 40)], logits=True).logits[0]
    assert torch.equal(before, after)


def test_the_chunked_prefill_is_compiled_before_any_trace(stand_in, tiny):
    """Issue 37 point 3: TT's prefill warm-up stops at max_prefill_chunk_size, so the chunked path's programs (chunked
    SDPA: one per chunk start and page-table width in real ttnn 0.81.1) compiled at the first long prompt, after the
    decode traces were captured (their kernel binaries allocated under a live trace, which a replay may overwrite).
    warm_up now prefills once at every padded length TT chunks, into the sink block, before anything is traced."""
    stand_in.setitem(stand_in_tt.MAX_PREFILL_CHUNK_SIZES_DIV1024, "Tiny-1B", {"N150": 2})
    lm = build(mesh_of((1, 1)), tiny, users=1, max_seq_len=4200)
    lm.warm_up(2, 0, ())
    lm.prepare_traces()
    mesh = lm.tt.mesh_device
    assert lm.traces and not mesh.unsafe
    lm.prefill(0, long_prompt(4150))  # padded to 6,144: three chunks of 2,048
    assert any(name == "chunked_sdpa@4096" for name, _ in mesh.compiled)
    assert [u for u in mesh.unsafe if not isinstance(u, weakref.ref)] == []  # no program compiled under the traces


def on_a_galaxy(tt_model):
    """A stand-in model whose args and attention say what TT-Transformers' say on a TG (the stand-in cannot hold 32
    devices): ModelArgs.is_galaxy, and tt/attention.py's batch_size_per_device_group for a 32-row batch and 8 KV heads,
    32 // (32 // 8) = 8 users per mesh column."""
    tt_model.args.is_galaxy = True
    for layer in tt_model.model.layers:
        layer.attention.batch_size_per_device_group = 8
    return tt_model


def test_a_galaxy_step_keeps_to_one_mesh_columns_users(stand_in, tiny):
    """Issue 37's third review, F1: on a Galaxy TT gives each of the 4 mesh columns 8 of the tile's 32 rows and its
    own KV caches (positions and page-table rows split over the columns, prepare_decode_inputs_host), and some
    attention.py versions fill only column 0's caches in a paged prefill: a user's verify rows in tile rows 8-31
    attended to caches nobody filled, or that its earlier rows never wrote. A step now holds at most one column's 8
    rows, a batch past them is refused in one line, and the run's traces are planned for 8 rows."""
    mesh = mesh_of((1, 1))
    lm = TtnnCausalLM(on_a_galaxy(build_tt_model(mesh, tiny.folder, tiny.name, 2, 192, True)), 2, 192,
                      mesh_traces=mesh_traces(mesh))
    assert lm.max_step_rows == 8
    with pytest.raises(ValueError, match=r"^a step of 9 rows does not fit one Galaxy mesh column's rows \(8\)$"):
        lm.step([UserRows(0, [1, 2, 3, 4, 5], 0), UserRows(1, [1, 2, 3, 4], 0)])
    with pytest.raises(UserError, match=r"^max_batch_size 16: on a Galaxy .* use max_batch_size 8 or fewer$") as e:
        TtnnCausalLM(lm.tt, 16, 192, mesh_traces=mesh_traces(mesh))
    assert e.value.parameter == "max_batch_size"  # which the demo words as its flag (inputs.flags_named)
    assert str(e.value.named_as("--batch_size")).endswith("use --batch_size 8 or fewer")
    drafts = SpeculativeGenerator(lm, SuffixDrafter(1), 16)
    assert sum(drafts._draft_caps([SimpleResult()] * 2, [[1, 2]] * 2, 64)) + 2 <= 8  # the rows shared within 8


class SimpleResult:
    output_tokens: list = []


def test_prefill_warm_prompts_cover_every_padded_length_and_the_short_prompts_tiles(stand_in, tiny):
    """F2: the warm-up prefills one prompt of every padded length TT's sweep leaves out (get_padded_prefill_len pads to
    128, 1,024, then powers of two; the sweep stops at the 4k chunk: 8,192 and 16,384 are left), not only the lengths
    TT chunks, and every (padded length, blocks) class of the prompts up to PER_TILE_WARM_POSITIONS tokens."""
    from models.tt_transformers.ttnn_backend.model import PER_TILE_WARM_POSITIONS, prefill_warm_prompts

    stand_in.setitem(stand_in_tt.MAX_PREFILL_CHUNK_SIZES_DIV1024, "Tiny-1B", {"N150": 4})
    args = build_tt_model(mesh_of((1, 1)), tiny.folder, tiny.name, 1, 12000, True).args
    prompts = prefill_warm_prompts(args, 12000)
    padded = {stand_in_tt.get_padded_prefill_len(n) for n in prompts} | set(args.get_warmup_prefill_supported_seq_lens())
    assert padded == {stand_in_tt.get_padded_prefill_len(n) for n in range(1, 12001)}
    assert {8192, 12000} <= set(prompts)  # 12,000 stands for 8,193..12,000 (padded to 16,384, past the cache)
    short = {(stand_in_tt.get_padded_prefill_len(n), -(-n // 32)) for n in prompts if n <= PER_TILE_WARM_POSITIONS}
    swept = {(n, n // 32) for n in args.get_warmup_prefill_supported_seq_lens()} | {(128, 1)}
    assert short | swept >= {(stand_in_tt.get_padded_prefill_len(n), -(-n // 32))
                             for n in range(1, PER_TILE_WARM_POSITIONS + 1)}
    assert len(prompts) == len(set(prompts)) and not set(prompts) & set(args.get_warmup_prefill_supported_seq_lens())


def programs_compiled_by(mesh, run) -> set:
    before = set(mesh.compiled)
    run()
    return set(mesh.compiled) - before


def test_every_prefill_program_a_prompt_can_need_is_compiled_before_any_trace(stand_in, tiny):
    """F2: TT's sweep stops at 128 and 1024 x 2^k, so a prompt padded to 256 or 512 compiled its prefill programs
    with the decode traces live (their kernel binaries allocated under a trace, which a replay may overwrite); and
    TT's last-token ttnn.slice and paged_fill_cache compile per last-token tile and page-table width (ttnn 0.81.1
    keys a slice by its offsets, a fill by its page table's shape). After warm_up and the capture, no prompt up to
    max_seq_len (here within PER_TILE_WARM_POSITIONS) compiles anything, nor are the traces made again."""
    lm = build(mesh_of((1, 1)), tiny, users=1, max_seq_len=600)
    lm.warm_up(2, 0, ())
    lm.prepare_traces()
    mesh, traces = lm.tt.mesh_device, {key: t.trace_id for key, t in lm.traces.items()}
    for n in (5, 33, 70, 129, 200, 257, 300, 450, 513, 599, 600):
        assert programs_compiled_by(mesh, lambda: lm.prefill(0, long_prompt(n))) == set(), n
        lm.step([UserRows(0, [3], n - 1)])
    assert {key: t.trace_id for key, t in lm.traces.items()} == traces
    assert [u for u in mesh.unsafe if not isinstance(u, weakref.ref)] == []


def test_a_prefill_that_compiles_under_live_traces_has_them_made_again(stand_in, tiny):
    """F2, past PER_TILE_WARM_POSITIONS (a prefill per 32 positions would cost a prompt-long prefill each): a prompt
    whose last-token tile no warm-up ran compiles its slice and fill programs while the decode traces are live; the
    backend sees the program cache grow (num_program_cache_entries) and makes every trace on the mesh again before
    any replay, so no replay can overwrite those programs. Before, the next prompt of that length ran a program a
    replay had overwritten."""
    lm = build(mesh_of((1, 1)), tiny, users=1, max_seq_len=1400)
    lm.warm_up(2, 0, ())
    lm.prepare_traces()
    mesh, before = lm.tt.mesh_device, {key: t.trace_id for key, t in lm.traces.items()}
    new = programs_compiled_by(mesh, lambda: lm.prefill(0, long_prompt(1100)))  # padded to 2,048, tile 1,088
    assert any(name.startswith("slice@(0, 0, 1088") for name, _ in new), new
    assert set(lm.traces) == set(before) and not set(before.values()) & {t.trace_id for t in lm.traces.values()}
    assert [u for u in mesh.unsafe if not isinstance(u, weakref.ref)] == []
    lm.step([UserRows(0, [3], 1100)])
    lm.prefill(0, long_prompt(1100))  # the same programs again, after a replay
    assert lm.step([UserRows(0, [3], 1100)]).ids



def test_a_prompt_over_128_tokens_below_1024_max_seq_len(stand_in, tiny):
    """Issue 46 (prompt padding): TT pads a prompt of 129..1,024 tokens to 1,024 (tt/common.py get_padded_prefill_len
    at 622c6fb9) and prepare_inputs_prefill asserts the padded prompt fits ModelArgs' rotary tables: ModelArgs got the
    next power of two of --max_seq_len (256 for 192), so TT's warm-up and every prompt over 128 tokens stopped there
    ("Sequence length 1024 exceeds max seq len 256"). Now it gets the padded length, and the prompt's logits are the
    same as in a model built for 1,024 positions."""
    users = 2
    lm = build(mesh_of((1, 1)), tiny, users=users, max_seq_len=192)
    assert lm.tt.args.max_seq_len == 1024 and lm.max_seq_len == 192
    lm.warm_up(2, 0, ())
    prompt = long_prompt(150)
    got = lm.prefill(1, prompt, logits=True).logits[0]
    wide = build(mesh_of((1, 1)), tiny, users=users, max_seq_len=1024)
    assert torch.equal(got, wide.prefill(1, prompt, logits=True).logits[0])
    assert torch.equal(lm.step([UserRows(1, [5], 150)], logits=True).logits[0],
                       wide.step([UserRows(1, [5], 150)], logits=True).logits[0])


def test_the_warm_up_runs_tt_prefill_sweep_without_tt_sampling(stand_in, tiny):
    """Issue 46 (TT's warm-up on ttnn 0.81.1): TT's first prefill_forward_text runs Generator.warmup_model_prefill,
    whose first length is prefilled once per on-device sampling configuration when the model has TT's sampling module;
    on one device that sweep's top k is refused by the 0.81.1 wheel, and this backend never samples through TT's
    module. The backend runs TT's warm-up itself, every length once, with no sampling parameters."""
    calls = []
    prefill = stand_in_tt.Generator.prefill_forward_text

    def recorded(self, tokens, *args, **kwargs):
        calls.append((tokens.shape[-1], kwargs.get("sampling_params")))
        return prefill(self, tokens, *args, **kwargs)
    stand_in.setattr(stand_in_tt.Generator, "prefill_forward_text", recorded)
    lm = build(mesh_of((1, 1)), tiny, max_seq_len=1024)
    assert lm.tt.model.sampling is not None  # TT built its sampling module: its own warm-up would sweep it
    lm.warm_up(2, 0, ())
    swept = lm.tt.args.get_warmup_prefill_supported_seq_lens()
    assert all(param is None for _, param in calls), [param for _, param in calls]
    assert lm.tt.generator.already_warmed_up_prefill
    assert [n for n, _ in calls[: len(swept)]] == swept


def test_a_model_over_a_whole_galaxy_is_refused_before_anything_is_built(stand_in, tiny):
    """Issue 46 (Galaxy): TT-Transformers' tensor parallelism over all 32 devices of a Galaxy fails TT's own checks at
    622c6fb9 (prefill's rotary embedding, decode's QKV matmul); TT runs models there on 1 x 8 submeshes. A build over
    the whole mesh is refused in one line naming the fix, before TT's ModelArgs is made."""
    made = []
    stand_in.setattr(stand_in_ttnn, "AVAILABLE_DEVICES", 32)  # a Galaxy's system
    stand_in.setattr(stand_in_tt.ModelArgs, "__init__", lambda self, *a, **k: made.append(a))
    with pytest.raises(UserError) as refused:
        build_tt_model(mesh_of((8, 4)), tiny.folder, tiny.name, 8, 1024, True)
    assert refused.value.parameter == "mesh_device" and "\n" not in str(refused.value)
    assert "submesh of 8 devices" in str(refused.value) and not made


def test_a_galaxys_model_mesh_is_tts_first_1x8_submesh_closed_before_the_galaxy(stand_in):
    """Issue 46 (Galaxy): the mesh a model runs on there is TT's first create_submeshes(mesh, 4) (the Galaxy reshaped
    to 4 x 8, rows of 8), made once, with the Galaxy's trace region. Both share a command queue, and ttnn 0.81.1
    refuses to close the Galaxy while the submesh has used it: the submesh closes first (make tt-mock's Galaxy died
    at the close)."""
    stand_in.setattr(stand_in_ttnn, "AVAILABLE_DEVICES", 32)
    stand_in.setenv("MESH_DEVICE", "TG")
    with tt_device.open_mesh(trace_region_size=STAND_IN_TRACE_REGION) as galaxy:
        submesh = tt_device.model_mesh(galaxy)
        assert submesh.shape == (1, 8) and galaxy.shape == (4, 8) and tt_device.model_mesh(galaxy) is submesh
        assert tt_device.TRACE_REGIONS[id(submesh)] == STAND_IN_TRACE_REGION
        assert tt_device.model_mesh(mesh_of((1, 8))).shape == (1, 8)  # any other mesh is its own
        ones = stand_in_ttnn.from_torch(torch.ones(32, 32), device=submesh, layout=stand_in_ttnn.TILE_LAYOUT)
        stand_in_ttnn.add(ones, ones)  # the model's mesh uses the shared command queue
        assert submesh.cq_in_use and not galaxy.cq_in_use
    assert submesh.closed and galaxy.closed and not tt_device.SUBMESHES and not tt_device.TRACE_REGIONS
