# SPDX-License-Identifier: Apache-2.0
"""The ttnn backend's host-side logic, run against the stand-in (tests/tt_stand_in: a TEST DOUBLE for ttnn and
TT-Transformers that models the device's constraints; it is not a device and proves nothing about one).

Lossless on a TT device means identical to plain greedy decoding through the same verify-shaped step (TT numerics
depend on the batch shape), so the reference here is plain decoding through the stand-in's own 32-row step.
"""
import pytest
import torch

from models.tt_transformers.speculative.generator import SpeculativeGenerator
from models.tt_transformers.speculative.backend import UserRows
from models.tt_transformers.speculative import SpeculativeConfig, make_drafter
from models.tt_transformers.speculative.drafters import ModelDrafter, SuffixDrafter
from models.tt_transformers.checkpoints.checkpoint import resolve_checkpoint
from models.tt_transformers.torch_backend.load import load_model
from models.tt_transformers.torch_backend.causal_lm import TorchCausalLM
from models.tt_transformers.ttnn_backend import attention as ordered_attention
from models.tt_transformers.ttnn_backend.causal_lm import TtnnCausalLM

from ..stand_in_backend import MAX_SEQ_LEN, backend_builder, outputs
from ..tt_stand_in import ttnn as stand_in_ttnn

def drafter_for(lm, mode):
    """Copied drafts from the request alone, from 1-token matches too (some pass whole, some fail at once); a view of
    the first 8 layers; both in the hybrid, the view priced at 0.3 of a step."""
    config = SpeculativeConfig(draft_mode=mode, sa_threshold=1, draft_memory=0, recycle_top_k=0, draft_layers=8,
                               draft_head="none")
    return make_drafter(config, lm, draft_cost=0.3)


def test_logits_match_the_torch_backend_in_float32(tt, embedded_checkpoint, prompts):
    """The stand-in's decode and verification steps compute the same model as the torch backend (float32)."""
    lm = tt(2, float32=True)
    torch_lm = TorchCausalLM(load_model(embedded_checkpoint, torch.float32, MAX_SEQ_LEN, cpu_kernels=False), 30, 2)
    prompt_a, prompt_b = prompts[0][:40], prompts[1][:25]
    errors = []
    for user, p in enumerate((prompt_a, prompt_b)):
        ours = lm.prefill(user, p, logits=True).logits[0]
        ref = torch_lm.forward_logits([p], [0], [user], last_only=True)[0]
        errors.append((ours - ref).abs().max().item())
    rows = [UserRows(0, [11, 22, 33, 44], 40), UserRows(1, [55, 66], 25)]  # a verify step: 4 rows + 2 rows
    ours = lm.step(rows, logits=True)
    ref = torch_lm.forward_logits([r.tokens for r in rows], [r.start_pos for r in rows], [0, 1])
    for got, want, ids in zip(ours.logits, ref, ours.ids):
        errors.append((got - want).abs().max().item())
        assert ids == want.argmax(dim=-1).tolist()
    print(f"stand-in vs torch backend, float32 logits: max abs error {max(errors):.2e}")
    assert max(errors) < 2e-3


EAGLE3_TAPS = (2, 15, 27)  # an EAGLE-3 head's default taps (2, N // 2, N - 3) for the embedded model's 30 layers


def block_errors(ours: torch.Tensor, ref: torch.Tensor, dim: int) -> list[float]:
    """Per tapped layer (a dim-wide block of columns): max abs error over the reference block's max magnitude."""
    return [((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
            for a, b in zip(ours.split(dim, dim=1), ref.split(dim, dim=1))]


def test_taps_match_the_torch_backend_in_float32(tt, embedded_checkpoint, prompts):
    """What an EAGLE-3 head reads: the residual stream entering layers 2, 15 and 27, concatenated in that order, for
    the prompt (read back from TT's prefill as it runs the layers) and for a verify step's rows (left in the tap tile),
    against the torch backend's taps (float32)."""
    lm = tt(2, float32=True)
    torch_lm = TorchCausalLM(load_model(embedded_checkpoint, torch.float32, MAX_SEQ_LEN, cpu_kernels=False), 30, 2)
    dim = torch_lm.model.args.dim
    prompt = prompts[0][:40]
    ours = lm.prefill(0, prompt, taps=EAGLE3_TAPS).hidden[0]
    ref = torch_lm.prefill(0, prompt, taps=EAGLE3_TAPS).hidden[0]
    assert ours.shape == ref.shape == (40, 3 * dim) and ours.dtype == torch.bfloat16
    errors = block_errors(ours, ref, dim)
    rows = [UserRows(0, [11, 22, 33, 44], 40)]
    lm.step(rows, taps=EAGLE3_TAPS)
    ours, ref = lm.read_taps(EAGLE3_TAPS)[:4], torch_lm.step(rows, taps=EAGLE3_TAPS).hidden[0]
    assert ours.shape == ref.shape == (4, 3 * dim)
    errors += block_errors(ours, ref, dim)
    print(f"stand-in vs torch backend, taps {EAGLE3_TAPS} (read back in bf16): max relative error {max(errors):.2e}")
    assert max(errors) < 1e-2
    assert {key.taps for key in lm.traces} == {EAGLE3_TAPS}  # the tapped traces are their own


def test_taps_come_from_the_layers_named(tt, embedded_checkpoint, prompts):
    """Tap 0 is the token embedding; asking for the same layers in another order permutes the blocks; a layer asked
    twice comes twice; ids outside [0, n_layers) are refused in one line (a draft view's range is its own). Tapping
    leaves TT-Transformers' layer objects as they were (self.layers, their attention and cache)."""
    lm = tt(1)
    dim = lm.tt.args.dim
    lm.prefill(0, prompts[1][:20])
    rows = [UserRows(0, [5, 17, 300, 41], 20)]
    layers, attention = list(lm.tt.model.layers), [layer.attention for layer in lm.tt.model.layers]
    def tapped(taps):
        lm.step(rows, taps=taps)
        return lm.read_taps(taps)[:4]

    out = tapped((0, 9))
    embedding = load_model(embedded_checkpoint, torch.bfloat16, MAX_SEQ_LEN, cpu_kernels=False).tok_embeddings
    assert torch.equal(out[:, :dim], embedding(torch.tensor(rows[0].tokens)).float())
    swapped = tapped((9, 0))
    assert torch.equal(swapped, torch.cat([out[:, dim:], out[:, :dim]], dim=1))
    assert torch.equal(tapped((9, 9, 0)), torch.cat([out[:, dim:], swapped], dim=1))
    assert not torch.equal(out[:, :dim], out[:, dim:])
    assert lm.tt.model.layers == layers and [layer.attention for layer in layers] == attention
    assert all("forward" not in vars(layer) for layer in layers)  # the class's forward again
    for bad in ((30,), (-1,), (0, 31)):
        with pytest.raises(ValueError, match=r"layer ids must be in \[0, 30\)"):
            lm.step(rows, taps=bad)
    with pytest.raises(ValueError, match=r"layer ids must be in \[0, 30\)"):
        lm.prefill(0, prompts[1][:20], taps=(30,))
    with pytest.raises(ValueError, match=r"layer ids must be in \[0, 8\)"):
        lm.draft_view(8).step(rows, taps=(8,))


def test_tap_capture_restores_the_layers_when_a_layer_fails(monkeypatch):
    """A tapped layer that raises while a trace is compiled or captured leaves every layer's forward as it was."""
    from models.tt_transformers.ttnn_backend import taps as tt_taps

    class Layer:
        def forward(self, x):
            raise RuntimeError("op failed")

    layers = [Layer(), Layer()]
    with pytest.raises(RuntimeError, match="op failed"):
        with tt_taps.TapCapture(layers, (1, 0), copy=lambda x: x) as capture:
            layers[1].forward(5)  # how LightweightModule.__call__ calls it
    assert capture.outputs == {0: [], 1: [5]}
    assert all("forward" not in vars(layer) for layer in layers)


# model drafts at batch 1 (44 s here) behind --run_slow: batch 4 covers the same drafts through the same verify step
@pytest.mark.parametrize("mode,batch", [(m, b) for m in ("suffix", "model", "hybrid") for b in (1, 4) if (m, b) != ("model", 1)]
                         + [pytest.param("model", 1, marks=pytest.mark.slow)])
def test_speculative_identical_to_plain_through_the_verify_step(tt, prompts, plain_outputs, mode, batch):
    """The four prompts (a copy task and three chat prompts) in batches of `batch` users, verify attention grouped
    (--grouped_verify 1; the other tests run it per row, the default)."""
    lm = tt(batch, grouped=True)
    groups = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
    results = [SpeculativeGenerator(lm, drafter_for(lm, mode), 6).generate(g, 32) for g in groups]
    assert [output for group in results for output in outputs(group)] == plain_outputs
    steps = [it for group in results for r in group for it in r.iterations if it.drafted]
    assert any(it.accepted == 0 for it in steps)  # drafts rejected at their first token
    if mode != "model":  # the copy prompt's suffix drafts pass whole (the 8-layer draft never does here)
        assert any(it.accepted == it.drafted >= 2 for it in steps)
    assert {key.passes for key in lm.traces} <= {1, 2, 4, 8}  # a trace per number of write passes, captured once
    # issue 47: the verify steps' attention ran grouped (one spec_multi_pos_tiles scan per user), the plain ones per row
    grouped = {name for name, _ in lm.tt.mesh_device.compiled if name.startswith("paged_sdpa_decode@")}
    assert grouped and grouped <= {"paged_sdpa_decode@2", "paged_sdpa_decode@4", "paged_sdpa_decode@8"}


def test_generation_to_the_end_of_the_cache(tt, prompts):
    """Long drafts up to the last page of a user's cache: stops at max_seq_len exactly like plain decoding. Each run
    on a fresh backend, so nothing plain decoding wrote can stand in for a write the speculative run lost."""
    max_seq_len = len(prompts[0]) + 40
    plain = outputs(SpeculativeGenerator(tt(1, max_seq_len), None, 0).generate(prompts[:1], 1000))
    assert len(prompts[0]) + len(plain[0]) == max_seq_len
    assert outputs(SpeculativeGenerator(tt(1, max_seq_len), SuffixDrafter(1), 16).generate(prompts[:1], 1000)) == plain


def recorded_cache_writes(monkeypatch) -> list:
    """Every paged_update_cache the stand-in runs, as (cache, rows' update, positions, page table) tensors: the
    update's data is what the op wrote, read after the step."""
    writes, update = [], stand_in_ttnn._paged_update

    def recording(cache, data, positions, page_table):
        writes.append((cache, data, positions, page_table))
        update(cache, data, positions, page_table)
    monkeypatch.setattr(stand_in_ttnn, "_paged_update", recording)
    return writes


def lost_writes(writes) -> int:
    """Rows whose keys or values are not in the cache as sequential writes (one row at a time) would leave them."""
    lost = 0
    for cache, data, positions, page_table in writes:
        for b, pos in enumerate(positions.data.tolist()):
            if pos != -1:
                block = int(page_table.data[b, pos // stand_in_ttnn.BLOCK])
                lost += not torch.equal(cache.data[block, :, pos % stand_in_ttnn.BLOCK],
                                        stand_in_ttnn.stored(data.data[0, b], cache.dtype).to(cache.data.dtype))
    return lost


def test_every_row_of_a_verify_step_is_written(tt, prompts, monkeypatch):
    """One verify step of 2 users x 7 rows, each user's rows inside one 32-position block: after it, every row's
    keys and values are in the cache (checked against what each update op was given); with the batched write
    TT-Transformers issues (every row in one op) rows are lost."""
    def verify_step(lm):
        lm.prefill(0, prompts[0][:40])  # TT's prefill warm-up compiles its programs before any trace exists
        lm.step([UserRows(0, [0] * 7, 100)])  # compiles and captures the 8-pass trace: what follows is a replay
        for user in (0, 1):
            lm.prefill(user, prompts[user][:40])
        writes = recorded_cache_writes(monkeypatch)
        lm.step([UserRows(0, prompts[0][40:47], 40), UserRows(1, prompts[1][40:47], 40)])
        return writes

    writes = verify_step(tt(2))
    assert len(writes) == 2 * 8 * 30  # (K, V) x 8 passes (7 rows round up to the ladder's 8) x 30 layers
    assert lost_writes(writes) == 0
    batched_writes(monkeypatch)
    assert lost_writes(verify_step(tt(2))) > 0


def batched_writes(monkeypatch) -> None:
    """TT-Transformers' own cache write (every row in one paged_update_cache) in place of the ordered passes, and the
    backend's check that its passes reached TT's attention (TtnnCausalLM._check_ordered_writes) off, which would
    refuse such a model at its first compile: what that check guards against, made to happen."""
    monkeypatch.setattr(ordered_attention, "ordered_update", lambda update_op, passes: update_op)
    monkeypatch.setattr(TtnnCausalLM, "_check_ordered_writes", lambda self, passes: None)


def test_a_model_whose_cache_writes_bypass_the_ordered_passes_is_refused(tt, prompts, monkeypatch):
    """Issue 37's third review, F5: a TT-Transformers that reaches paged_update_cache some other way (bound at import,
    fused) would write a verify step's rows in one op, racing, with no error; the backend counts the writes that went
    through its passes when it compiles a step and refuses in one line."""
    monkeypatch.setattr(ordered_attention, "ordered_update", lambda update_op, passes: update_op)
    lm = tt(1)
    lm.prefill(0, prompts[0][:40])
    with pytest.raises(RuntimeError, match=r"^the ordered cache writes did not reach TT-Transformers' attention: a 30-"
                                           r"layer decode step made 0 K/V writes through them \(60 expected\)"):
        lm.step([UserRows(0, prompts[0][40:43], 40)])


def test_ordered_cache_writes_are_needed(tt, prompts, plain_outputs, monkeypatch):
    """With one batched paged_update_cache (the race), a user's verify rows that share a cache block lose their
    keys and values, and speculative output drifts from plain decoding: the ordered passes are what prevent it.
    Both runs on fresh backends whose caches hold only what they wrote."""
    assert outputs(SpeculativeGenerator(tt(1), SuffixDrafter(2), 6).generate(prompts[:1], 32)) == plain_outputs[:1]
    batched_writes(monkeypatch)
    assert outputs(SpeculativeGenerator(tt(1), SuffixDrafter(2), 6).generate(prompts[:1], 32)) != plain_outputs[:1]


def test_racing_write_model():
    """The stand-in's paged_update_cache: rows in the same block in one op keep only the last row's write. (The update
    is height sharded one row per core, as the op wants it: paged_update_cache_device_operation.cpp.)"""
    t = stand_in_ttnn
    mesh = t.open_mesh_device()
    cache = t.from_torch(torch.zeros(4, 1, 32, 2), layout=t.TILE_LAYOUT, device=mesh)
    update = t.from_torch(torch.arange(1, 7, dtype=torch.float32).view(1, 3, 1, 2), dtype=t.bfloat16,
                          layout=t.TILE_LAYOUT, device=mesh)  # rows [1 2] [3 4] [5 6]
    update = t.to_memory_config(update, t.create_sharded_memory_config((32, 32), t.CoreGrid(y=1, x=3), t.ShardStrategy.HEIGHT,
                                                                      use_height_and_width_as_shard_shape=True))
    rows = torch.tensor([[2, 3], [2, 3], [1, 0]])
    pos = t.from_torch(torch.tensor([5, 6, 40]), dtype=t.int32, device=mesh)
    t.experimental.paged_update_cache(cache, update, update_idxs_tensor=pos, page_table=t.from_torch(rows, dtype=t.int32,
                                                                                                    device=mesh))
    written = cache.data
    assert written[2, 0, 5].abs().sum() == 0 and written[2, 0, 6].tolist() == [3.0, 4.0]  # row 0 lost to row 1
    assert written[0, 0, 8].tolist() == [5.0, 6.0]  # position 40 of row 2: its second block, slot 8


def test_traces_replay_without_allocating(tt, prompts):
    """After the traces exist, a step refreshes inputs in place and replays: no device allocation in the loop; an
    op first seen during capture, an unknown trace id and a host tensor of another shape all fail on the stand-in."""
    lm = tt(2)
    gen = SpeculativeGenerator(lm, SuffixDrafter(2), 3)
    gen.generate(prompts[:2], 16)  # captures the traces this workload needs
    mesh, step, steps = lm.tt.mesh_device, lm.step, []

    def counting(*args, **kwargs):  # TT's prefill allocates between replays (as on a device): the steps must not
        before = mesh.allocations
        out = step(*args, **kwargs)
        steps.append(mesh.allocations - before)
        return out
    lm.step = counting
    gen.generate(prompts[:2], 16)
    assert steps and set(steps) == {0}
    t, mesh = stand_in_ttnn, lm.tt.mesh_device
    with pytest.raises(RuntimeError, match="never captured"):
        t.execute_trace(mesh, 999, cq_id=0)
    with pytest.raises(RuntimeError, match="same shape"):
        t.copy_host_to_device_tensor(t.from_torch(torch.zeros(31, dtype=torch.int64), dtype=t.int32),
                                     lm.inputs.step.current_pos)
    t.begin_trace_capture(mesh, cq_id=0)
    with pytest.raises(RuntimeError, match="not compiled before trace capture"):
        t.argmax(t.from_torch(torch.zeros(1, 1, 64, 8), device=mesh), dim=-1)


def test_row_budget_and_idle_users(tt, prompts):
    """Every step fits the 32-row tile however many users draft; users that finish go idle at position -1, and the
    traced shape stays 32 rows."""
    lm = tt(4)
    prompts = [prompts[0]] * 3 + [prompts[1]]  # three copy tasks draft long; the chat prompt ends first
    seen = []
    step = lm.step

    def recording(rows, logits=False, top_k=0, taps=()):
        seen.append((sum(len(r.tokens) for r in rows), len(rows)))
        out = step(rows, logits, top_k, taps)
        seen[-1] += (lm.inputs.step.current_pos.data.tolist(),)
        return out
    lm.step = recording
    with pytest.raises(ValueError, match=r"^a step of 33 rows does not fit the decode tile \(32\)$"):
        step([UserRows(0, list(range(20)), 0), UserRows(1, list(range(13)), 0)])
    results = SpeculativeGenerator(lm, SuffixDrafter(1), 16, eos_token_ids=[2]).generate(prompts, 60)
    assert 16 < max(rows for rows, _, _ in seen) <= 32
    for rows, users, positions in seen:
        assert len(positions) == 32 and positions.count(-1) == 32 - rows
    assert any(users < 4 for _, users, _ in seen)  # some users finished first and went idle
    assert len({len(r.output_tokens) for r in results}) > 1


def test_draft_view_shares_the_target_cache(tt, prompts):
    """The first-layers draft reads and writes the target's cache for its layers: no prefill of its own."""
    lm = tt(1)
    view = lm.draft_view(12)
    assert view.shares_target_cache and view.tt.kv_cache == lm.tt.kv_cache[:12]
    calls = []
    view.prefill = lambda *a, **k: calls.append(a)
    results = SpeculativeGenerator(lm, ModelDrafter(view), 4).generate(prompts[:1], 12)
    assert calls == [] and sum(it.drafted for it in results[0].iterations) > 0


# first-layer drafts (50 s here) behind --run_slow: suffix drafts cover the ttnn verify path, and
# tests/speculative/test_lossless_sampling.py and tests/speculative/test_seeded_sampling.py cover draft-model drafts under sampling
@pytest.mark.parametrize("kind", ["suffix", pytest.param("model", marks=pytest.mark.slow), "accept-all"])
def test_sampling_through_the_verify_step_follows_the_target(monkeypatch, tmp_path, kind):
    """Keyed sampling through the ttnn backend (logits read back from the traced verify step, padded vocabulary
    columns sliced off): the first 5 tokens of 8-user batches follow the target's exact distribution (chi-square,
    as tests/speculative/test_lossless_sampling.py), with suffix and first-layer drafts verified whole chains at a time; a
    verifier that accepts every draft fails the same test."""
    from models.tt_transformers.speculative import generator as speculative_generator
    from models.tt_transformers.speculative.sampling import SamplingParams

    from ..conftest import save_tiny_hf_checkpoint
    from ..speculative.test_lossless_sampling import (N_DRAFT, N_TOKENS, PROMPT, SETTINGS, VOCAB, chi_square_p_value, draft_source,
                                         exact_joint, sequence_index)

    folder = tmp_path / "Tiny-4"
    save_tiny_hf_checkpoint(folder, vocab_size=VOCAB, initializer_range=0.4, seed=3)
    ckpt = resolve_checkpoint(str(folder))
    expected = exact_joint(load_model(ckpt, torch.float32, 64, cpu_kernels=False), SETTINGS)
    lm = backend_builder(monkeypatch, ckpt)(8, 64, float32=True)
    lm.step_cost = lambda n_users, n_rows, context_len: 1.0  # whole chains: this tests verification, not the policy
    drafter = draft_source(lm, "model" if kind == "model" else "suffix")
    if kind == "accept-all":
        monkeypatch.setattr(speculative_generator, "verify_chain", lambda draft, target: draft + [target[len(draft)]])
    counts, full_chains = torch.zeros(VOCAB ** N_TOKENS), 0
    for b in range(300):
        gen = SpeculativeGenerator(lm, drafter, N_DRAFT, (), SamplingParams(SETTINGS.temperature, SETTINGS.top_k,
                                                                            SETTINGS.top_p, seed=b))
        for r in gen.generate([PROMPT] * 8, N_TOKENS, stop_at_eos=False):
            counts[sequence_index(r.output_tokens)] += 1
            full_chains += sum(it.drafted >= N_DRAFT for it in r.iterations)
    p_value = chi_square_p_value(counts, expected)
    if kind == "accept-all":
        assert p_value < 1e-3
    else:
        assert p_value > 1e-3 and full_chains >= 300 * 8 // 2, (p_value, full_chains)


def test_step_cost_prices_cached_positions_from_the_models_bytes(tt, embedded_checkpoint):
    """Issue 37 point 10: a row reading one cached position costs the K and V bytes of every layer there over the
    weight bytes a step streams, as TT stores them (bfloat8_b, FF1/FF3 bfloat4_b under the performance preset; the
    cache's own dtype), not a fixed 2e-6 (5.7x too low for Llama-3.1-8B, 52x for this model). Counted here from the
    stand-in's cache tensors and the checkpoint's weight tensors."""
    lm = tt(1, grouped=True)
    weights = load_model(embedded_checkpoint, torch.float32, 16, cpu_kernels=False)  # nn.Linear layers (float32)
    bfp4, bfp8 = 576 / 1024, 1088 / 1024  # bytes a value: a 32 x 32 tile's mantissas and its 64 shared exponents
    streamed = weights.output.weight.numel() * bfp8 + sum(
        layer.feed_forward.w_gate_up.weight.numel() * bfp4 + sum(
            w.weight.numel() for w in (layer.attention.wqkv, layer.attention.wo, layer.feed_forward.w_down)) * bfp8
        for layer in weights.layers)
    positions = lm.tt.kv_cache[0][0].data.shape[0] * lm.tt.kv_cache[0][0].data.shape[2]  # blocks x block size
    assert {v.dtype for layer in lm.tt.kv_cache for v in layer} == {"bfloat8_b"}
    kv = sum(v.data.numel() for layer in lm.tt.kv_cache for v in layer) / positions * bfp8
    one_scan = 1000 * kv / streamed
    # issue 47: a step of one user's 5 rows runs attention in one group (attention.group_tiles: 8 candidates) and reads
    # the cache once; where the groups do not fit the tile (32 users of 8 rows), each row reads it. Without
    # grouped_attention (--grouped_verify 0, the default) every row reads it, as a plain step's row
    assert lm.grouped_attention and lm.group_tiles(8) == 8
    lm.grouped_attention = False
    assert lm.group_tiles(8) == 1
    assert lm.step_cost(1, 5, 1000) - lm.step_cost(1, 5, 0) == pytest.approx(5 * one_scan, rel=1e-9)
    lm.grouped_attention = True
    assert lm.step_cost(1, 5, 1000) - lm.step_cost(1, 5, 0) == pytest.approx(one_scan, rel=1e-9)
    lm.max_batch_size = 32
    assert lm.group_tiles(8) == 1
    assert lm.step_cost(1, 5, 1000) - lm.step_cost(1, 5, 0) == pytest.approx(5 * one_scan, rel=1e-9)
    # several users: each holds a scan of its own (one user holding every row beyond the first, as the passes)
    lm.max_batch_size = 4
    assert lm.step_cost(3, 7, 1000) - lm.step_cost(3, 7, 0) == pytest.approx(3 * one_scan, rel=1e-9)


def test_greedy_traces_slice_no_logits(tt):
    """Issue 37 point 10: the logits' first rows a sampled step reads are sliced only in a sampled run's programs: a
    greedy run's traces record three ops fewer each."""
    lm = tt(2)
    mesh = lm.tt.mesh_device
    lm.warm_up(5, 0, ())
    lm.prepare_traces()
    assert lm.traces and all(not t.first_rows for t in lm.traces.values())
    greedy = {(key.passes, key.top_k): len(mesh.traces[t.trace_id]) for key, t in lm.traces.items()}
    lm.warm_up(5, 0, (), logits=True)
    lm.prepare_traces()
    sampled = {(key.passes, key.top_k): len(mesh.traces[t.trace_id]) for key, t in lm.traces.items()}
    assert all(sorted(t.first_rows) == [4, 8, 16] for t in lm.traces.values())
    assert sampled == {shape: ops + 3 for shape, ops in greedy.items()}
