# SPDX-License-Identifier: Apache-2.0
"""The EAGLE-3 draft head on the device (ttnn_backend/eagle3_head.py), run against the stand-in (tests/tt_stand_in: a
TEST DOUBLE for ttnn and TT-Transformers; it is not a device and proves nothing about one): the taps stay in the tap
tile, the head's traced replays feed it and draft chains, only ids and probabilities come back. Lossless here means
identical to plain greedy decoding through the same 32-row verify step, as in tests/ttnn_backend/test_ttnn_backend.py."""
import pytest
import torch

from models.tt_transformers.speculative import SpeculativeConfig, make_drafter
from models.tt_transformers.speculative.generator import SpeculativeGenerator
from models.tt_transformers.speculative.backend import DeviceRows, UserRows
from models.tt_transformers.speculative.drafters import HybridDrafter, SuffixDrafter
from models.tt_transformers.speculative.drafters.eagle3_base import RunCost
from models.tt_transformers.speculative.drafters.eagle3_device import HeadFeed, TracedHeadDrafter
from models.tt_transformers.checkpoints.safetensors_index import read_embedding
from models.tt_transformers.checkpoints.eagle3_format import read_draft_head
from models.tt_transformers.torch_backend.eagle3_head import HeadRunner, build_draft_head
from models.tt_transformers.torch_backend.model import Transformer
from models.tt_transformers.checkpoints.model_shape import ModelShape
from models.tt_transformers.ttnn_backend.eagle3_head import CONFIDENCE_TOP, FILL_ROWS, TtnnDraftHead
from models.tt_transformers.ttnn_backend.model import TILE_ROWS
from models.tt_transformers.ttnn_backend.trace_plan import head_trace_keys, head_trace_ops

from ..conftest import random_head_tensors
from ..tt_stand_in import ttnn as stand_in_ttnn
from ..stand_in_backend import MAX_SEQ_LEN, outputs

CHAIN = 4  # --n_draft_tokens: the head's traced chain length


def device_head(lm, checkpoint, head, tmp_path, chain=CHAIN, weights_dtype=None):
    """A TtnnDraftHead beside a stand-in target as the demo builds it (the checkpoint's embedding, unless the head
    ships one), the target's traces for the head's taps planned and made first."""
    config, weights = head
    args = ModelShape.from_hf_config(checkpoint.config)
    embedding = weights.get("embed_tokens.weight", None)
    embedding = read_embedding(checkpoint) if embedding is None else embedding
    lm.warm_up(chain + 1, 0, config.taps)
    dev = TtnnDraftHead(lm, config, weights, embedding, chain, args, weights_dtype, cache_dir=tmp_path / "head")
    dev.warm_up()
    lm.prepare_traces()  # every model planned, then the mesh's traces made once (as the demo's warm_up)
    return dev


def random_head(checkpoint, std=0.05, **kw):
    return random_head_tensors(ModelShape.from_hf_config(checkpoint.config), seed=3, std=std, **kw)


def test_device_head_logits_match_the_torch_head_in_float32(tt, embedded_checkpoint, prompts, tmp_path):
    """A random EAGLE-3 head (with a draft vocabulary and d2t) fed a prompt's taps, then drafting a chain on the
    device: every chain step's draft-vocabulary logits against the torch head's (HeadRunner, float32) fed the same
    states and the same tokens. Tolerance 1e-3 of the largest logit: float32 on both sides, different op order."""
    lm = tt(2, float32=True)
    head = random_head(embedded_checkpoint, draft_vocab=20000)
    dev = device_head(lm, embedded_checkpoint, head, tmp_path, weights_dtype=stand_in_ttnn.float32)  # bf16 KV cache
    prompt = prompts[1][:45]
    out = lm.prefill(1, prompt, taps=head[0].taps)
    context = prompt + out.ids[0]
    drafted = dev.draft([HeadFeed(1, 0, context[1:], states=out.hidden[0])], [1], CHAIN)[1]

    target = Transformer(ModelShape.from_hf_config(embedded_checkpoint.config), torch.float32, MAX_SEQ_LEN)
    target.tok_embeddings.weight.data = read_embedding(embedded_checkpoint, torch.float32)
    runner = HeadRunner(build_draft_head(*head, target), 2, MAX_SEQ_LEN, target.args)
    state, logits = runner.run([1], [0], [out.hidden[0].float()], [context[1:]])[0]
    errors, ids = [], []
    for j in range(CHAIN):
        ours = dev.read_logits(j)[dev.last_rows[1]]  # the row user 1 drafted in
        errors.append(((ours - logits).abs().max() / logits.abs().max()).item())
        ids.append(int(runner.vocab[logits.argmax()]))
        state, logits = runner.run([1], [len(prompt) + j], [state[-1:]], [[ids[-1]]])[0]
    print(f"device head vs torch head, float32, {CHAIN} chain steps: max error {max(errors):.2e} of the largest logit")
    assert max(errors) < 1e-3
    assert drafted[0] == ids  # the chain's ids, mapped to the target's through d2t
    assert all(0 < p <= 1 for p in drafted[1])


@pytest.mark.parametrize("which,mode,batch", [("random", mode, batch) for mode in ("head", "hybrid") for batch in (1, 4)]
                         + [("shipped", "hybrid", 4)])
def test_device_head_identical_to_plain_through_the_verify_step(tt, embedded_checkpoint, prompts, plain_outputs,
                                                                tmp_path, which, mode, batch):
    """A random EAGLE-3 head (24k-token draft vocabulary) in head and hybrid modes at batches of 1 and 4, and the shipped
    head as the demo runs it (hybrid, 4 users): the same tokens as plain decoding through the same step (what the head
    drafts is the torch head's: test_device_head_logits_match_the_torch_head_in_float32)."""
    from models.tt_transformers.checkpoints.eagle3_format import DRAFT_HEADS

    lm = tt(batch)
    args = ModelShape.from_hf_config(embedded_checkpoint.config)
    head = read_draft_head(DRAFT_HEADS / embedded_checkpoint.name, args) if which == "shipped" else \
        random_head(embedded_checkpoint, std=0.3, draft_vocab=24000)  # confident enough to draft
    drafter = TracedHeadDrafter(device_head(lm, embedded_checkpoint, head, tmp_path))
    drafter.cost = RunCost(0.05, measure=False)  # the stand-in's times are no device's
    if mode == "hybrid":
        drafter = HybridDrafter(SuffixDrafter(1), drafter)
    groups = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
    results = [r for g in groups for r in SpeculativeGenerator(lm, drafter, CHAIN).generate(g, 32)]
    assert outputs(results) == plain_outputs
    assert any(it.draft_source == "head" for r in results for it in r.iterations)  # the head drafted
    assert set(lm.traces) | set(drafter_head(drafter).traces) <= planned(lm, drafter_head(drafter))  # nothing new


def test_the_library_default_drafts_with_the_shipped_head_on_the_device(tt, prompts, plain_outputs):
    """make_drafter(SpeculativeConfig(), target) on a ttnn target: the demo's default, copied drafts beside the head
    shipped for the model, built on the device by the backend (TtnnCausalLM.draft_head); the same tokens as plain
    decoding through the same step."""
    lm = tt(4)
    drafter = make_drafter(SpeculativeConfig(n_draft_tokens=CHAIN), lm)
    assert isinstance(drafter, HybridDrafter) and isinstance(drafter.fallback, TracedHeadDrafter)
    assert drafter.fallback.head.chain_len == CHAIN and drafter.taps == (2, 15, 27)
    drafter.fallback.cost = RunCost(0.05, measure=False)  # the stand-in's times are no device's
    generator = SpeculativeGenerator(lm, drafter, CHAIN)
    generator.warm_up()
    results = generator.generate(prompts, 32)
    assert outputs(results) == plain_outputs
    assert any(it.draft_source == "head" for r in results for it in r.iterations)


def drafter_head(drafter):
    return getattr(drafter, "fallback", drafter).head


def planned(lm, head) -> set:
    return set(lm.planned) | set(head.planned)


def test_a_drafting_replay_ends_in_two_reads(tt, embedded_checkpoint, prompts, tmp_path, monkeypatch):
    """Issue 31's finding 3: the chain's ids and top values are joined on the device, so a replay drafting K tokens
    is read back in two reads (ids, values), not 2 x K blocking reads; the drafts are the steps' argmaxes and each
    confidence the softmax over the step's top values (finding 2)."""

    lm = tt(2)
    dev = device_head(lm, embedded_checkpoint, random_head(embedded_checkpoint, draft_vocab=20000), tmp_path)
    out = lm.prefill(0, prompts[1][:40], taps=dev.taps)
    reads, to_torch = [], stand_in_ttnn.to_torch
    monkeypatch.setattr(stand_in_ttnn, "to_torch", lambda t, *a, **k: reads.append(tuple(t.shape)) or
                        to_torch(t, *a, **k))
    drafted = dev.draft([HeadFeed(0, 0, prompts[1][1:40] + out.ids[0], states=out.hidden[0])], [0], CHAIN)[0]
    assert reads == [(1, 1, CHAIN, TILE_ROWS), (1, 1, TILE_ROWS, CHAIN * CONFIDENCE_TOP)]
    row = dev.last_rows[0]
    logits = [dev.read_logits(j)[row] for j in range(CHAIN)]
    assert drafted[0] == dev.vocab[[int(step.argmax()) for step in logits]].tolist()
    top = [step.topk(CONFIDENCE_TOP).values for step in logits]
    assert drafted[1] == pytest.approx([float(torch.softmax(t, dim=0)[0]) for t in top], rel=1e-5)


def test_every_head_op_runs_with_tt_decode_configs(tt, embedded_checkpoint, prompts, tmp_path, monkeypatch):
    """Issue 31's finding 1 (configs): every rms_norm and linear of the head gets a compute-kernel config (norms HiFi2
    with fp32 accumulation; matmuls HiFi2 with fp32 accumulation, as TT's decode matmuls, since issue 37 measured no
    difference from HiFi4 in the drafts: tools/head_precision.py) and SDPA decode TT's program config with the exact
    exp; before, each took its defaults."""

    lm = tt(1)
    dev = device_head(lm, embedded_checkpoint, random_head(embedded_checkpoint, draft_vocab=20000), tmp_path)
    out = lm.prefill(0, prompts[1][:40], taps=dev.taps)
    seen = {}
    for name in ("rms_norm", "linear"):
        op = getattr(stand_in_ttnn, name)
        monkeypatch.setattr(stand_in_ttnn, name, lambda *a, _op=op, _name=name, **k: seen.setdefault(_name, []).append(
            k.get("compute_kernel_config")) or _op(*a, **k))
    sdpa = stand_in_ttnn.transformer.paged_scaled_dot_product_attention_decode
    monkeypatch.setattr(stand_in_ttnn.transformer, "paged_scaled_dot_product_attention_decode",
                        lambda *a, **k: seen.setdefault("sdpa", []).append((k.get("compute_kernel_config"),
                                                                            k.get("program_config"))) or sdpa(*a, **k))
    dev.trace = False  # the ops run now, where they can be seen (eager: the same program)
    dev.draft([HeadFeed(0, 0, prompts[1][1:40] + out.ids[0], states=out.hidden[0])], [0], CHAIN)
    fidelity = {name: {(c.math_fidelity, c.fp32_dest_acc_en) for c in configs} for name, configs in seen.items()
                if name != "sdpa"}
    assert fidelity == {"rms_norm": {("HiFi2", True)}, "linear": {("HiFi2", True)}}
    assert {(k.math_fidelity, p.exp_approx_mode, p.k_chunk_size) for k, p in seen["sdpa"]} == {("HiFi2", False, 256)}


def ops_run(monkeypatch) -> list:
    """The names of the stand-in ops run from now on (each op goes through run_op)."""
    names, run_op = [], stand_in_ttnn.run_op
    monkeypatch.setattr(stand_in_ttnn, "run_op", lambda name, *a, **k: names.append(name) or run_op(name, *a, **k))
    return names


def test_the_head_runs_tt_decode_attention_and_sampling_ops(tt, embedded_checkpoint, prompts, tmp_path, monkeypatch):
    """Issue 31's findings 4, 2 and 6, op by op (eager: the traced program's ops): q, k and v come from TT's
    nlp_create_qkv_heads_decode over the checkpoint's qkv rows alone (q and k permuted to Meta's pairs: no extra
    rotated columns), rotary_embedding_llama rotates them with TT's rotation matrix and nlp_concat_heads_decode joins the
    heads (no repeat, no tiled reshape); the confidence comes from topk on power-of-two slices (multi-core), not a
    one-core softmax and max over a row of the draft vocabulary; the argmax writes the next step's token tensor
    directly, so no reshape of ids either."""
    lm = tt(1)
    config, weights = head = random_head(embedded_checkpoint, draft_vocab=20000)
    dev = device_head(lm, embedded_checkpoint, head, tmp_path)
    a = config.layer
    assert sum(w.shape[-1] for w in dev.weights["layer.attention.wqkv.weight"]) == \
        (a.n_heads + 2 * a.n_kv_heads) * a.head_dim
    out = lm.prefill(0, prompts[1][:40], taps=dev.taps)
    dev.trace = False
    single_core = lm.tt.mesh_device.single_core_topk
    names = ops_run(monkeypatch)
    dev.draft([HeadFeed(0, 0, prompts[1][1:40] + out.ids[0], states=out.hidden[0])], [0], CHAIN)
    fills = names.count("nlp_create_qkv_heads")  # the prompt's earlier rows: k rotated once per fill
    assert fills == 1 and names.count("rotary_embedding_llama") == 2 * CHAIN + fills
    assert names.count("nlp_create_qkv_heads_decode") == names.count("nlp_concat_heads_decode") == CHAIN
    assert not {"repeat", "reshape", "softmax", "max"} & set(names)
    assert names.count("topk") == CHAIN and lm.tt.mesh_device.single_core_topk == single_core


def test_a_prompt_goes_in_by_prefill_shaped_fills_then_one_replay(tt, embedded_checkpoint, prompts, tmp_path,
                                                                  monkeypatch):
    """Issue 31's finding 7: a prompt's rows before its last K + 1 go into the head's cache FILL_ROWS at a time with
    TT's prefill-shaped ops (nlp_create_qkv_heads, rotary_embedding_llama, paged_fill_cache into the chunk's page-table
    slice), and one replay feeds the rest and drafts: 600 rows take 3 fills and 1 replay where they took 120 replays.
    The drafts are the torch head's fed the same states (float32)."""
    lm = tt(1, max_seq_len=640, float32=True)
    head = random_head(embedded_checkpoint, draft_vocab=20000)
    dev = device_head(lm, embedded_checkpoint, head, tmp_path, weights_dtype=stand_in_ttnn.float32)
    prompt = (prompts[1] * 20)[:600]
    out = lm.prefill(0, prompt, taps=dev.taps)
    names = ops_run(monkeypatch)
    replays, execute = [], stand_in_ttnn.execute_trace
    monkeypatch.setattr(stand_in_ttnn, "execute_trace", lambda *a, **k: replays.append(a) or execute(*a, **k))
    drafted = dev.draft([HeadFeed(0, 0, prompt[1:] + out.ids[0], states=out.hidden[0])], [0], CHAIN)[0]
    fills = -(-(600 - (CHAIN + 1)) // FILL_ROWS)
    assert (len(replays), names.count("paged_fill_cache"), names.count("nlp_create_qkv_heads")) == (1, 2 * fills, fills)

    target = Transformer(ModelShape.from_hf_config(embedded_checkpoint.config), torch.float32, 640)
    target.tok_embeddings.weight.data = read_embedding(embedded_checkpoint, torch.float32)
    runner = HeadRunner(build_draft_head(*head, target), 1, 640, target.args)
    state, logits = runner.run([0], [0], [out.hidden[0].float()], [prompt[1:] + out.ids[0]])[0]
    ids = []
    for j in range(CHAIN):
        ids.append(int(runner.vocab[logits.argmax()]))
        state, logits = runner.run([0], [600 + j], [state[-1:]], [[ids[-1]]])[0]
    assert drafted[0] == ids


def test_head_traces_hold_no_more_ops_than_the_region_counts(tt, embedded_checkpoint, tmp_path):
    """trace_plan.head_trace_ops (what the trace region is sized by) is not below the ops a captured head trace
    records, for every key."""
    lm = tt(1)
    dev = device_head(lm, embedded_checkpoint, random_head(embedded_checkpoint, draft_vocab=20000), tmp_path)
    mesh = lm.tt.mesh_device
    recorded = {key: mesh.trace_sizes[t.trace_id] // stand_in_ttnn.TRACE_OP_BYTES for key, t in dev.traces.items()}
    assert all(ops <= head_trace_ops(key) for key, ops in recorded.items()), recorded


def test_the_step_leaves_the_taps_in_the_tile(tt, embedded_checkpoint, prompts, tmp_path):
    """A tapped step returns where each user's rows sit in the tap tile (DeviceRows) and writes the tile: the named
    layers' inputs, in the order asked, equal to what the prefill reads back for the same positions."""
    lm = tt(2, float32=True)
    taps = (9, 0, 20)
    lm.warm_up(5, 0, taps)
    prompt = prompts[0][:30]
    whole = lm.prefill(0, prompt, taps=taps).hidden[0]  # [30, 3 * dim], read back from TT's prefill
    lm.prefill(0, prompt[:26], taps=taps)
    out = lm.step([UserRows(1, [5], 0), UserRows(0, prompt[26:30], 26)], taps=taps)
    assert out.hidden == [DeviceRows(0, 0), DeviceRows(1, 26)]
    tile = lm.read_taps(taps)
    error = ((tile[1:5] - whole[26:30].float()).abs().max() / whole.float().abs().max()).item()
    assert error < 2e-2  # the prefill's chunked attention against the decode step's (bfloat16 read-back)


def test_head_traces_are_planned_and_counted(tt, embedded_checkpoint, tmp_path):
    """The head's traces are (feed passes, k) for the feeds a chain's verification can need, each feed-only and
    drafting; they are made with the target's (MeshTraces.prepare) and counted against the trace region."""
    lm = tt(1)
    dev = device_head(lm, embedded_checkpoint, random_head(embedded_checkpoint), tmp_path)
    assert head_trace_keys(CHAIN) == [(1, 0), (1, 4), (2, 0), (2, 4), (4, 0), (4, 4), (5, 0), (5, 4)]
    assert set(dev.traces) == set(head_trace_keys(CHAIN)) == dev.planned
    assert all(key in lm.traces for key in lm.planned)
    args = ModelShape.from_hf_config(embedded_checkpoint.config)
    with pytest.raises(ValueError, match="taps"):
        TtnnDraftHead(tt(1), *random_head(embedded_checkpoint, taps=(1, 2, 3)), read_embedding(embedded_checkpoint),
                      CHAIN, args, cache_dir=tmp_path / "b").warm_up()
    with pytest.raises(ValueError, match=r"^chain_len 40: .* 1 to 32 tokens .*; lower it"):
        TtnnDraftHead(lm, *random_head(embedded_checkpoint), read_embedding(embedded_checkpoint), 40, args)


def test_converted_weights_are_cached(tt, embedded_checkpoint, tmp_path):
    """The head's weights are converted once (ttnn.as_tensor with cache_file_name, as TT-Transformers caches its own):
    a second head from the same files reads them back; the tables that depend on the run (rotary rows over its
    cache's positions, the draft-id embedding from its target's) are built each time, never read from the cache
    (as_tensor loads a cached file whatever its shape)."""
    head = random_head(embedded_checkpoint)
    first = device_head(tt(1), embedded_checkpoint, head, tmp_path)
    files = sorted(p.name for p in (tmp_path / "head").iterdir())
    assert files and any("lm_head" in f for f in files) and not any("rope" in f or "embedding" in f for f in files)
    second = device_head(tt(1, max_seq_len=2 * MAX_SEQ_LEN), embedded_checkpoint, head, tmp_path)
    assert sorted(p.name for p in (tmp_path / "head").iterdir()) == files
    for name, w in first.weights.items():
        assert all(torch.equal(x.data, y.data) for x, y in zip(*(
            ws if isinstance(ws, list) else [ws] for ws in (w, second.weights[name])))), name
    assert (first.tables["rope_cos"].shape[2], second.tables["rope_cos"].shape[2]) == (first.blocks * 32,
                                                                                        second.blocks * 32)
    assert second.blocks > first.blocks


def test_a_feed_only_replay_writes_the_cache_and_nothing_else(tt, embedded_checkpoint, prompts, tmp_path,
                                                               monkeypatch):
    """Issue 37 point 10: a replay that drafts nothing (the hybrid took every user's copied draft) runs the feed's
    cache writes only: no attention, LM head, argmax or top k. What the head drafts next is what it drafts after a
    full feed of the same rows (a one-layer head's cache rows depend on each row's own input)."""
    lm = tt(1)
    lm.trace = False  # the heads follow: their ops run now, where they can be counted
    head = random_head(embedded_checkpoint, draft_vocab=20000)
    feed_only, full = (device_head(lm, embedded_checkpoint, head, tmp_path / name) for name in ("a", "b"))
    prompt = prompts[1][:40]
    out = lm.prefill(0, prompt, taps=feed_only.taps)
    first = feed_only.draft([HeadFeed(0, 0, prompt[1:] + out.ids[0], states=out.hidden[0])], [0], CHAIN)[0][0]
    assert full.draft([HeadFeed(0, 0, prompt[1:] + out.ids[0], states=out.hidden[0])], [0], CHAIN)[0][0] == first

    def fed(rows, start):  # a verified step of `rows` for user 0 at `start`, its tapped rows fed (all accepted)
        step = lm.step([UserRows(0, rows, start)], taps=feed_only.taps)
        return [HeadFeed(0, start, rows[1:] + [step.ids[0][-1]], tile_rows=range(len(rows)))]
    rows = [out.ids[0][0], *first]
    feeds = fed(rows, len(prompt))
    calls = []  # the ops a feed-only replay must not run, counted over its draft() alone
    for name in ("argmax", "topk"):
        op = getattr(stand_in_ttnn, name)
        monkeypatch.setattr(stand_in_ttnn, name,
                            lambda *a, _op=op, _name=name, **k: calls.append(_name) or _op(*a, **k))
    sdpa = stand_in_ttnn.transformer.paged_scaled_dot_product_attention_decode
    monkeypatch.setattr(stand_in_ttnn.transformer, "paged_scaled_dot_product_attention_decode",
                        lambda *a, **k: calls.append("sdpa") or sdpa(*a, **k))
    assert feed_only.draft(feeds, [], 0) == {} and calls == []
    assert full.draft(feeds, [0], CHAIN) and calls  # a drafting replay runs them
    again = [11, 12, 13]
    assert feed_only.draft(fed(again, len(prompt) + len(rows)), [0], CHAIN) == \
        full.draft(fed(again, len(prompt) + len(rows)), [0], CHAIN)
