# SPDX-License-Identifier: Apache-2.0
"""The ttnn serving class (serving/ttnn_model.py) on the stand-in: tests/tt_stand_in, a TEST DOUBLE for ttnn,
TT-Transformers and TT-Transformers' vLLM classes (tests/tt_stand_in/generator_vllm.py, mirroring tt-metal's
generator_vllm.py). It is not a device and proves nothing about one: what it shows is that the class drives
TT-Transformers' vLLM surface as the plugin's runner calls it, and that its verify on vLLM's paged KV cache, with the
page table a scheduler sends each step, gives the package's own verify's greedy ids.

The plugin's side is played by a small scheduler written here (Scheduler: vLLM's block pool and per-request block
tables, block 0 its null block, blocks handed out shuffled) and by serving/reference_runner.py's loop.
"""
import functools
import importlib.util
import os
import re
import sys
import types

import pytest
import torch

from models.tt_transformers.serving import ttnn_model
from models.tt_transformers.serving.contract import (
    ACCEPT_MODE_ARGMAX_IDS,
    MODEL_OWNED_DRAFTER,
    SpecReject,
    VerifyOutput,
    accept_greedy_drafts,
)
from models.tt_transformers.serving.plan import SPEC_CAPABILITIES, plan_speculation
from models.tt_transformers.serving.reference_runner import BlockPool, ReferenceRunner
from models.tt_transformers.speculative.backend import UserRows
from models.tt_transformers.speculative.generator import SpeculativeGenerator
from models.tt_transformers.speculative.metrics import NUM_DRAFTS
from models.tt_transformers.ttnn_backend.causal_lm import TtnnCausalLM
from models.tt_transformers.ttnn_backend.model import build_tt_model, named_checkpoint
from models.tt_transformers.ttnn_backend.trace_plan import pass_ladder

from ..stand_in_backend import STAND_IN_TRACE_REGION, mesh_traces
from ..tt_stand_in import generator_vllm as stand_in_generator_vllm
from ..tt_stand_in import install
from ..tt_stand_in import tt_transformers as stand_in_tt
from ..tt_stand_in import ttnn as stand_in_ttnn
from .helpers import generator, plain_with_recomputes

BATCH = 4  # the padded decode batch (ModelArgs' supported batch sizes: 1, 2, 4, 8, 16, 32)
MAX_SEQ_LEN = 256  # a power of two (TT's prefill warm-up rule)
BLOCK = 32  # vLLM's block size here: the stand-in pages in blocks of 32 (make tt-mock runs 64 on real ttnn)
N_LAYERS = 4  # the checkpoint's first layers (TT's n_layers; the package's own reference alike): the stand-in is slow


def t(values):
    return torch.tensor(values, dtype=torch.int32)


def vllm_config(k, max_num_seqs=BATCH):
    speculative = None if k is None else types.SimpleNamespace(method="custom_class", model=MODEL_OWNED_DRAFTER,
                                                               num_speculative_tokens=k)
    return types.SimpleNamespace(speculative_config=speculative,
                                 scheduler_config=types.SimpleNamespace(max_num_seqs=max_num_seqs),
                                 model_config=types.SimpleNamespace(max_model_len=MAX_SEQ_LEN))


class Served:
    """The class as the plugin's runner brings it up (TTModelLoader.load_model, then initialize_kv_cache's
    allocate_kv_cache, then warmup_model: prefill and decode warm-up, phase 1 without traces, phase 2 with)."""

    def __init__(self, monkeypatch, tmp_path, checkpoint, k, trace=True):
        install(monkeypatch)
        monkeypatch.setattr(ttnn_model, "_CLASSES", {})
        folder = named_checkpoint(checkpoint.folder, checkpoint.name)
        monkeypatch.setenv("HF_MODEL", str(folder))
        monkeypatch.setenv("TT_CACHE_PATH", str(tmp_path))
        self.mesh = stand_in_ttnn.open_mesh_device(stand_in_ttnn.MeshShape(1, 1),
                                                   trace_region_size=STAND_IN_TRACE_REGION)
        self.cls = ttnn_model.SpecLlamaForCausalLM
        hf_config = types.SimpleNamespace(_name_or_path=str(folder))
        self.model = self.cls.initialize_vllm_model(hf_config, self.mesh, BATCH, MAX_SEQ_LEN, n_layers=N_LAYERS,
                                                    tt_data_parallel=1, optimizations=None, vllm_config=vllm_config(k))
        args = self.model.model_args[0].torch_args
        self.width = -(-MAX_SEQ_LEN // BLOCK)  # max_num_blocks_per_req
        self.num_blocks = BATCH * self.width + 1
        self.kv_cache = self.model.allocate_kv_cache((self.num_blocks, args.n_kv_heads, BLOCK, args.head_dim),
                                                     torch.bfloat16, N_LAYERS)
        self.vocab_size = args.vocab_size
        self.model.warmup_model_prefill(kv_cache=self.kv_cache, enable_trace=False, can_sample_on_device=True)
        phases = (False, True) if trace else (False,)
        for enable_trace in phases:
            self.model.warmup_model_decode(kv_cache=self.kv_cache, enable_trace=enable_trace, max_batch_size=BATCH,
                                           num_blocks=self.width, can_sample_on_device=True)


class Scheduler:
    """vLLM's side of the page table, as far as the model sees it: the reference runner's block pool (block 0 is
    vLLM's null block, never a request's; free blocks handed out in a shuffled order, so no table is the identity)
    with a block table per decode slot that follows its request through a slot_remap, grown to cover every position a
    step writes (the K + 1 lookahead the plugin reserves for custom_class)."""

    def __init__(self, served: Served, seed=0):
        self.served, self.pool = served, BlockPool(served.num_blocks, BLOCK, served.width, seed)
        self.layout_changed = True  # model_runner.py@02f45e5f _decode_layout_changed_since_last_decode

    def cover(self, slot: int, positions: int) -> None:
        self.pool.cover(slot, positions)

    def release(self, slot: int) -> None:
        self.pool.release(slot)
        self.layout_changed = True

    def remap(self, slot_remap) -> None:
        if slot_remap is not None:
            self.layout_changed = True
            old = self.pool.tables
            self.pool.tables = {i: old[j] for i, j in enumerate(torch.as_tensor(slot_remap).tolist()) if j in old}

    def table(self, slots) -> torch.Tensor:
        return self.pool.table(list(slots))

    def prefill(self, prompts, slots) -> list[int]:
        """Prefill prompts into slots (the runner's submit_prefill keywords); each one's greedy first token."""
        for slot, prompt in zip(slots, prompts):
            self.release(slot)
            self.cover(slot, len(prompt))
        width = max(len(p) for p in prompts)
        tokens = torch.tensor([list(p) + [0] * (width - len(p)) for p in prompts], dtype=torch.int32)
        logits = self.served.model.prefill_forward(
            tokens=tokens, page_table=self.table(slots), kv_cache=self.served.kv_cache,
            prompt_lens=[len(p) for p in prompts], start_pos=torch.zeros(len(prompts), dtype=torch.int32),
            empty_slots=list(slots), enable_trace=False)
        return logits.reshape(len(prompts), -1).argmax(dim=-1).tolist()

    def decode(self, tokens, start_pos, read_from_device=False, **kwargs):
        """One decode step with the runner's submit_decode keywords (async_decode.py, read at dca5656f): the
        slot_remap moves the block tables with their requests, every live row's positions are covered, and the step
        gets this step's table; reset_batch, the legacy reload keyword, when the batch's layout changed since the last
        decode (a prefill, a departure, a remap). read_from_device False is what the pinned runner's synchronous
        path passes (model_runner.py@02f45e5f _forward_with_model_input); finalize_decode then hands output that is
        not on the host to the model's process_decode_output_host (TT's ids over its whole batch)."""
        self.remap(kwargs.get("slot_remap"))
        ends = start_pos.max(dim=1).values if start_pos.dim() == 2 else start_pos
        for slot, end in enumerate(ends.tolist()):
            if end >= 0:
                self.cover(slot, end + 1)
        spec = kwargs.get("spec_mode") is not None
        greedy = None if spec else stand_in_tt.SamplingParams(temperature=0.0, top_k=1, top_p=1.0)
        out = self.served.model.decode_forward(
            tokens=tokens, start_pos=start_pos, page_table=self.table(range(tokens.shape[0])),
            kv_cache=self.served.kv_cache, enable_trace=True, read_from_device=read_from_device,
            sampling_params=greedy, reset_batch=self.layout_changed, **kwargs)
        self.layout_changed = False
        if isinstance(out, list):  # TT's device output
            return self.served.model.process_decode_output_host(out, is_tokens=greedy is not None)
        return out


class RunnerModel:
    """What serving/reference_runner.py calls, passed to the served class with the scheduler's page tables."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler, self.model = scheduler, scheduler.served.model

    def prefill_forward(self, tokens, prompt_lens, empty_slots):
        return t(self.scheduler.prefill([tokens[r, :n].tolist() for r, n in enumerate(prompt_lens)], empty_slots))

    def decode_forward(self, tokens, start_pos, **kwargs):
        out = self.scheduler.decode(tokens, start_pos, **kwargs)
        if kwargs.get("spec_mode") is None:  # TT's decode sampling on the device: (ids over TT's batch, log probs)
            return out[0][: tokens.shape[0]].reshape(-1, 1).to(torch.int32)
        return out

    def propose_draft_tokens(self, *args, **kwargs):
        return self.model.propose_draft_tokens(*args, **kwargs)

    def release_request(self, slot):
        self.scheduler.release(slot)
        self.model.release_request(slot)

    def note_state_slots_moved(self, moves):
        self.model.note_state_slots_moved(moves)


def package_backend(monkeypatch, checkpoint, max_users=BATCH):
    """The package's own ttnn backend (model.build_tt_model, its own cache and page table; TtnnCausalLM) on the
    stand-in, over the checkpoint's first N_LAYERS layers as the served model."""
    install(monkeypatch)
    mesh = stand_in_ttnn.open_mesh_device(stand_in_ttnn.MeshShape(1, 1), trace_region_size=STAND_IN_TRACE_REGION)
    model = build_tt_model(mesh, checkpoint.folder, checkpoint.name, max_users, MAX_SEQ_LEN, True, n_layers=N_LAYERS)
    return TtnnCausalLM(model, max_users, MAX_SEQ_LEN, mesh_traces=mesh_traces(mesh))


def reference_ids(monkeypatch, checkpoint, prompts, blocks):
    """The package's own verify (TtnnCausalLM.step on its own cache and page table) over the same rows."""
    lm = package_backend(monkeypatch, checkpoint)
    for user, prompt in enumerate(prompts):
        lm.prefill(user, prompt)
    return lm.step([UserRows(u, tokens, pos) for u, tokens, pos in blocks], top_k=4).ids


def verify_block(rows_tokens, positions, k):
    """A [BATCH, 1+K] block as the runner builds it: live rows at their positions (padded draft columns -1 / -1),
    padding rows token 0 / position -1."""
    tokens = torch.zeros(BATCH, 1 + k, dtype=torch.int32)
    start = torch.full((BATCH, 1 + k), -1, dtype=torch.int32)
    num_valid = torch.zeros(BATCH, dtype=torch.int32)
    for row, (toks, pos) in enumerate(zip(rows_tokens, positions)):
        tokens[row] = -1
        tokens[row, : len(toks)] = t(toks)
        start[row, : len(toks)] = torch.arange(pos, pos + len(toks), dtype=torch.int32)
        num_valid[row] = len(toks) - 1
    return tokens, start, num_valid, torch.ones(BATCH, dtype=torch.int32)


def test_declarations_are_tt_transformers_plus_the_contracts(monkeypatch, tmp_path, embedded_checkpoint):
    """The class is TT-Transformers' LlamaForCausalLM underneath (the double), declares TT's capabilities plus the
    contract's, plans as plan.py plans, and is what the registration bundle names."""
    install(monkeypatch)
    monkeypatch.setattr(ttnn_model, "_CLASSES", {})
    cls = ttnn_model.SpecLlamaForCausalLM
    assert issubclass(cls, stand_in_generator_vllm.LlamaForCausalLM) and cls.__module__ == ttnn_model.__name__
    assert issubclass(ttnn_model.SpecMistralForCausalLM, stand_in_generator_vllm.MistralForCausalLM)
    assert cls.model_capabilities == {**stand_in_generator_vllm.LlamaForCausalLM.model_capabilities,
                                      **SPEC_CAPABILITIES}
    assert cls.spec_plan(None, 4, 7) == plan_speculation(None, 4, 7)
    assert cls.spec_plan(None, 4, 8).supported_k == tuple(range(1, 8))
    with pytest.raises(AttributeError):
        ttnn_model.NoSuchClass  # noqa: B018
    # the runner calls process_decode_output_host only where the model has one: the class has one where TT's has
    assert issubclass(cls, ttnn_model.VerifyReadBack)
    monkeypatch.delattr(stand_in_tt.Generator, "process_decode_output_host")
    monkeypatch.setattr(ttnn_model, "_CLASSES", {})
    assert not hasattr(ttnn_model.SpecLlamaForCausalLM, "process_decode_output_host")
    monkeypatch.setattr(stand_in_generator_vllm.LlamaForCausalLM, "process_decode_output_host",
                        lambda self, out, is_tokens=False: ("TT's", out), raising=False)
    monkeypatch.setattr(ttnn_model, "_CLASSES", {})
    model = ttnn_model.SpecLlamaForCausalLM.__new__(ttnn_model.SpecLlamaForCausalLM)
    model.spec = types.SimpleNamespace(verify_ids=t([[1, 2]]))
    assert model.process_decode_output_host(model.spec.verify_ids, is_tokens=True) is model.spec.verify_ids
    assert model.process_decode_output_host("device output", is_tokens=True) == ("TT's", "device output")


def test_model_bundles_register_through_the_plugins_hook(tmp_path, monkeypatch):
    """write_model_bundles' folders, read as the plugin reads EXTRA_MODELS_DIR (platform.py _iter_extra_model_bundles:
    every subfolder's vllm_metadata.json with `arch` and `main_class`; registered as "TT" + arch by
    _register_models_from_extra_dir), name this module's classes, which resolve as vLLM resolves a lazy
    registration (import the module, getattr the class)."""
    import importlib
    import json

    ttnn_model.write_model_bundles(tmp_path)
    registered = {}
    for folder in sorted(p for p in tmp_path.iterdir() if p.is_dir()):
        data = json.loads((folder / "vllm_metadata.json").read_text())
        registered["TT" + data["arch"]] = data["main_class"]
    assert registered == {"TTLlamaForCausalLM": "models.tt_transformers.serving.ttnn_model:SpecLlamaForCausalLM",
                          "TTMistralForCausalLM": "models.tt_transformers.serving.ttnn_model:SpecMistralForCausalLM"}
    install(monkeypatch)
    monkeypatch.setattr(ttnn_model, "_CLASSES", {})
    for main_class in registered.values():
        module, name = main_class.split(":")
        assert issubclass(getattr(importlib.import_module(module), name), ttnn_model.SpecDecodeModel)


def stand_in_launch(monkeypatch, tmp_path, embedded_checkpoint):
    """The stand-in installed, HF_MODEL naming the embedded checkpoint as TT names it, and a one-device mesh: what a
    launch builds the served class on. (checkpoint folder, mesh)"""
    install(monkeypatch)
    monkeypatch.setattr(ttnn_model, "_CLASSES", {})
    folder = named_checkpoint(embedded_checkpoint.folder, embedded_checkpoint.name)
    monkeypatch.setenv("HF_MODEL", str(folder))
    monkeypatch.setenv("TT_CACHE_PATH", str(tmp_path))
    mesh = stand_in_ttnn.open_mesh_device(stand_in_ttnn.MeshShape(1, 1), trace_region_size=STAND_IN_TRACE_REGION)
    return folder, mesh


def test_without_a_speculative_config_it_is_tt_transformers_class(monkeypatch, tmp_path, embedded_checkpoint):
    folder, mesh = stand_in_launch(monkeypatch, tmp_path, embedded_checkpoint)
    model = ttnn_model.SpecLlamaForCausalLM.initialize_vllm_model(
        types.SimpleNamespace(_name_or_path=str(folder)), mesh, BATCH, MAX_SEQ_LEN, vllm_config=vllm_config(None))
    assert model.spec is None
    assert type(model.model[0].layers[0].attention) is stand_in_tt.Attention  # TT's own attention, TT's cache update
    with pytest.raises(ValueError, match="tt_data_parallel 2"):
        ttnn_model.SpecLlamaForCausalLM.initialize_vllm_model(
            types.SimpleNamespace(_name_or_path=str(folder)), mesh, BATCH, MAX_SEQ_LEN, tt_data_parallel=2,
            vllm_config=vllm_config(3))


def test_the_launch_config_refusals_and_vllms_current_config(monkeypatch, tmp_path, embedded_checkpoint):
    """A speculative method other than custom_class with the model-owned-drafter sentinel (ngram: the plugin admits it
    for a device_propose model but never calls propose_draft_tokens, which this drafter learns from) is refused in one
    line naming the fix: by spec_plan (a SpecReject the plugin quotes) and by initialize_vllm_model (its plan checked
    again) before anything is built; so is a Galaxy (its verify rows must stay in one mesh column). Without the
    loader's vllm_config the class reads vLLM's current config (vllm.config); with none there it is TT's class, and
    speculative arguments reaching it are refused in one line."""
    folder, mesh = stand_in_launch(monkeypatch, tmp_path, embedded_checkpoint)
    cls, hf_config = ttnn_model.SpecLlamaForCausalLM, types.SimpleNamespace(_name_or_path=str(folder))
    built, build = [], stand_in_generator_vllm.initialize_vllm_text_transformer
    monkeypatch.setattr(stand_in_generator_vllm, "initialize_vllm_text_transformer",
                        lambda *args, **kwargs: built.append(1) or build(*args, **kwargs))
    fix = re.escape(f'launch with --speculative-config \'{{"method": "custom_class", "model": "{MODEL_OWNED_DRAFTER}"')
    for method, model in [("ngram", None), ("custom_class", "my.drafter")]:
        config = vllm_config(3)
        config.speculative_config.method, config.speculative_config.model = method, model
        reject = cls.spec_plan(config, BATCH, 3)
        assert isinstance(reject, SpecReject) and re.search(f"speculative method '{method}' .*{fix}", reject.reason)
        with pytest.raises(ValueError, match=f"speculative method '{method}' .*{fix}"):
            cls.initialize_vllm_model(hf_config, mesh, BATCH, MAX_SEQ_LEN, n_layers=N_LAYERS, vllm_config=config)
    galaxy = types.SimpleNamespace(get_num_devices=lambda: 32)  # an 8 x 4 mesh: refused before anything is built
    with pytest.raises(ValueError, match="^speculative decoding on a Galaxy is not served yet: .* launch without "
                                         "--speculative-config$"):
        cls.initialize_vllm_model(hf_config, galaxy, BATCH, MAX_SEQ_LEN, n_layers=N_LAYERS, vllm_config=vllm_config(3))
    assert not built
    vllm, current = types.ModuleType("vllm"), types.ModuleType("vllm.config")
    vllm.config, current.get_current_vllm_config = current, lambda: vllm_config(3)
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.config", current)
    model = cls.initialize_vllm_model(hf_config, mesh, BATCH, MAX_SEQ_LEN, n_layers=N_LAYERS)
    assert model.spec is not None and model.spec.num_drafts == 3
    current.get_current_vllm_config_or_none = lambda: None  # newer vLLM; none set
    model = cls.initialize_vllm_model(hf_config, mesh, BATCH, MAX_SEQ_LEN, n_layers=N_LAYERS)
    assert model.spec is None
    with pytest.raises(RuntimeError, match="built without a speculative config: pass the launch's vllm_config"):
        model.decode_forward(t([[1, 2]] * BATCH), t([[3, 4]] * BATCH), num_valid_drafts=t([1] * BATCH),
                             accepted_counts=t([1] * BATCH), spec_mode=ACCEPT_MODE_ARGMAX_IDS)
    del current.get_current_vllm_config_or_none

    def unset():
        raise AssertionError("Current vLLM config is not set.")
    current.get_current_vllm_config = unset
    assert ttnn_model.launch_config(None) is None
    monkeypatch.delitem(sys.modules, "vllm")
    monkeypatch.delitem(sys.modules, "vllm.config")
    if importlib.util.find_spec("vllm") is None:  # without vLLM the loader's vllm_config is the only source
        assert ttnn_model.launch_config(None) is None


@pytest.mark.parametrize("k", [1, 3, 7])
def test_verify_on_vllms_cache_and_page_table_is_the_packages_verify(monkeypatch, tmp_path, embedded_checkpoint,
                                                                     prompts, k):
    """Three requests prefilled into slots 0, 2 and 3 through TT's prefill with the scheduler's (shuffled) blocks; a
    verify with row 1 a padding row and draft columns of every length from none to K, on vLLM's cache with this
    step's page table, which has grown by a block for the rows that cross into one (prompts of 30 and 61 tokens):
    each live row's argmax ids are the package's own verify's (TtnnCausalLM.step on its own cache and identity page
    table) for the same tokens, and everything not verified is -1. Warm-up compiled every program of
    pass_ladder(1 + K) and captured each once; serving compiled and captured nothing."""
    served = Served(monkeypatch, tmp_path, embedded_checkpoint, k)
    verify = served.model.spec.verify
    assert sorted(key[0] for key in verify.lm.traces) == pass_ladder(1 + k)
    assert verify.lm.compiled == set(verify.lm.traces) == verify.lm.planned
    traces, compiled = set(served.mesh.traces), set(served.mesh.compiled)
    scheduler = Scheduler(served)
    chosen = [prompts[0][:30], prompts[1][:33], prompts[3][:61]]
    slots = [0, 2, 3]
    first = scheduler.prefill(chosen, slots)
    after_prefill = scheduler.table(range(BATCH))
    drafts = [[5, 6, 7, 8, 9, 10, 11][:n] for n in (k, k - 1, 0)]  # K, K - 1 and no drafts
    live = {slot: ([tok] + d, len(p)) for slot, tok, d, p in zip(slots, first, drafts, chosen)}
    tokens, start, num_valid, counts = verify_block([live[r][0] if r in live else [] for r in range(BATCH)],
                                                    [live[r][1] if r in live else 0 for r in range(BATCH)], k)
    tokens[1], start[1], num_valid[1] = 0, -1, 0  # slot 1: a padding row
    out = scheduler.decode(tokens, start, num_valid_drafts=num_valid, accepted_counts=counts,
                           spec_mode=ACCEPT_MODE_ARGMAX_IDS)
    assert isinstance(out, VerifyOutput) and out.spec_mode == ACCEPT_MODE_ARGMAX_IDS
    assert out.argmax_ids.dtype == torch.int32 and tuple(out.argmax_ids.shape) == (BATCH, 1 + k)
    ref = reference_ids(monkeypatch, embedded_checkpoint, chosen,
                        [(u, live[s][0], live[s][1]) for u, s in enumerate(slots)])
    for u, slot in enumerate(slots):
        n = len(live[slot][0])
        assert out.argmax_ids[slot, :n].tolist() == ref[u]
        assert out.argmax_ids[slot, n:].tolist() == [-1] * (1 + k - n)
    assert out.argmax_ids[1].tolist() == [-1] * (1 + k)
    table = scheduler.table(range(BATCH))
    assert table[[0, 2, 3]].ne(torch.arange(3).view(3, 1) * served.width + 1 + torch.arange(served.width)).any()
    assert k < 2 or not torch.equal(table, after_prefill)  # the step brought new blocks
    assert set(served.mesh.traces) == traces and served.mesh.compiled == compiled  # nothing made while serving
    assert verify.lm.compiled == verify.lm.planned


def test_plain_steps_are_tt_transformers_decode(monkeypatch, tmp_path, embedded_checkpoint, prompts):
    """Without the speculative arguments decode_forward is TT's own decode (the double's Generator.decode_forward),
    with TT's single cache update (no write passes set), the drafter told each live row's token. The double keeps
    TT's resident token and position inputs of a traced decode that samples on the device, which the host's replace
    only on reset_batch (or a mode switch): the first decode after a prefill gets the runner's reset_batch (the layout
    changed), the next the runner's False, read back as the pinned runner's synchronous path reads it
    (read_from_device False, then process_decode_output_host); after a verify the class reloads them (reset_batch
    forced), else TT would decode the tokens its last decode sampled at stale positions. Every step's ids are the
    package's own step's on the same rows. TT's decode takes its model's whole 32-row batch only (tt/model.py
    prepare_decode_inputs_host), which is why the class pads the plugin's rows."""
    served = Served(monkeypatch, tmp_path, embedded_checkpoint, 3)
    calls = []
    tt_decode = stand_in_generator_vllm.LlamaForCausalLM.decode_forward

    def recorded(self, *args, **kwargs):
        calls.append((kwargs.get("reset_batch"), list(served.model.spec.passes.positions)))
        return tt_decode(self, *args, **kwargs)
    monkeypatch.setattr(stand_in_generator_vllm.LlamaForCausalLM, "decode_forward", recorded)
    scheduler, n, first, lm = two_prefilled(monkeypatch, served, embedded_checkpoint, prompts)

    def plain(last, pos, **kwargs):
        """One TT decode of rows 0 and 1 (last tokens at positions pos), then the drafter's proposal after it."""
        out = scheduler.decode(t([[last[0]], [last[1]], [0], [0]]), t(pos + [-1, -1]), **kwargs)
        ids = out[0][:2].tolist()
        assert ids == [row[0] for row in lm.step([UserRows(u, [last[u]], pos[u]) for u in (0, 1)]).ids]
        committed, positions = (torch.full((BATCH, 4), -1, dtype=torch.int32) for _ in range(2))
        committed[:2, 0], positions[:2, 0] = t(ids), t([p + 1 for p in pos])
        drafted = served.model.propose_draft_tokens(3, committed, positions, torch.ones(BATCH, dtype=torch.int32))
        assert drafted.num_valid[2:].tolist() == [0, 0]  # padding rows draft nothing
        return out, ids

    out, ids = plain(first, n, read_from_device=True)
    assert tuple(out[0].shape) == (BATCH,)  # TT's 32 rows cut back to the plugin's B
    assert calls == [(True, [])]  # the runner's reset_batch: the layout changed with the prefill
    out, ids = plain(ids, [n[0] + 1, n[1] + 1])
    assert tuple(out[0].shape) == (32,) and calls[-1] == (False, [])  # TT's whole batch read back; steady
    pos = [n[0] + 2, n[1] + 2]
    tokens, start, num_valid, counts = verify_block([[ids[0], 7], [ids[1], 7]], pos, 3)
    verified = scheduler.decode(tokens, start, num_valid_drafts=num_valid, accepted_counts=counts,
                                spec_mode=ACCEPT_MODE_ARGMAX_IDS)
    ref = lm.step([UserRows(u, [ids[u], 7], pos[u]) for u in (0, 1)]).ids
    assert verified.argmax_ids[:2, :2].tolist() == ref
    committed, kept = accept_greedy_drafts(verified.argmax_ids, tokens[:, 1:], num_valid)
    ends = [pos[u] + int(kept[u]) for u in (0, 1)]  # each row's last committed token's position
    positions = torch.full((BATCH, 4), -1, dtype=torch.int32)
    for u in (0, 1):
        positions[u, : int(kept[u])] = torch.arange(pos[u] + 1, ends[u] + 1, dtype=torch.int32)
    served.model.propose_draft_tokens(3, committed, positions, kept)
    out, ids = plain([int(committed[u, int(kept[u]) - 1]) for u in (0, 1)], ends)
    assert calls[-1] == (True, [])  # after the verify: TT's resident inputs reloaded
    proposer = served.model.spec.core.proposer
    contexts = [proposer.requests[proposer.slots[s]].context for s in (0, 1)]
    assert [c[-1] for c in contexts] == ids and [len(c) for c in contexts] == [end + 2 for end in ends]
    with pytest.raises(AssertionError, match="Batch size 4 must be equal to max_batch_size 32"):  # TT's own rule
        tt_decode(served.model, t([[0]] * BATCH), t([-1] * BATCH), page_table=scheduler.table(range(BATCH)),
                  kv_cache=served.kv_cache, enable_trace=False)


def test_the_pinned_runners_narrow_verify_is_the_one_pass_program(monkeypatch, tmp_path, embedded_checkpoint,
                                                                 prompts):
    """model_runner.py@02f45e5f sends a decode step on which no row carries a draft (the first after a prefill
    always) as a one-column verify: [B, 1] tokens, [B] positions, spec_mode and both side tensors, read_from_device
    False. The class answers VerifyOutput(argmax_ids [B, 1] int32) from the verify's one-pass program captured at
    warm-up: the package's plain step's ids on live rows, -1 on padding rows; nothing is compiled or captured while
    serving, and TT's own decode is not called."""
    served = Served(monkeypatch, tmp_path, embedded_checkpoint, 3)
    verify = served.model.spec.verify
    traces, compiled = set(served.mesh.traces), set(served.mesh.compiled)
    tt_calls = []
    monkeypatch.setattr(stand_in_generator_vllm.LlamaForCausalLM, "decode_forward",
                        lambda self, *args, **kwargs: tt_calls.append(kwargs))
    scheduler = Scheduler(served)
    chosen = [prompts[0][:40], prompts[2][:33]]
    first = scheduler.prefill(chosen, [0, 2])
    out = scheduler.decode(t([[first[0]], [0], [first[1]], [0]]), t([len(chosen[0]), -1, len(chosen[1]), -1]),
                           num_valid_drafts=torch.zeros(BATCH, dtype=torch.int32),
                           accepted_counts=torch.ones(BATCH, dtype=torch.int32), spec_mode=ACCEPT_MODE_ARGMAX_IDS)
    assert isinstance(out, VerifyOutput) and out.argmax_ids.dtype == torch.int32
    assert tuple(out.argmax_ids.shape) == (BATCH, 1)
    ref = reference_ids(monkeypatch, embedded_checkpoint, chosen, [(u, [first[u]], len(chosen[u])) for u in (0, 1)])
    assert out.argmax_ids[:, 0].tolist() == [ref[0][0], -1, ref[1][0], -1]
    assert set(served.mesh.traces) == traces and served.mesh.compiled == compiled and not tt_calls
    assert verify.lm.compiled == verify.lm.planned


@pytest.mark.parametrize("narrow_verify", [True, False], ids=["narrow-verify", "ordinary-decode"])
def test_the_runners_loop_on_the_stand_in_is_plain_greedy(monkeypatch, tmp_path, embedded_checkpoint, prompts,
                                                          narrow_verify):
    """serving/reference_runner.py's loop (build the block, verify, greedy walk, commit, propose; draftless steps as
    the pinned runner's one-column verifies, or as TT's own decode as the contract document has them) drives the
    class through the scheduler's paged blocks, read back as the pinned runner's synchronous path reads it: four
    prompts at 3 concurrent requests (a padding row, the fourth waits), one preempted and replayed, rows compacted
    after departures. Every output equals plain greedy decoding through the package's own 32-row step on the
    stand-in, token for token, the preempted one with the same recompute (tests/serving/helpers.py: TT's prefill and
    decode programs differ, so a recompute need not give the uninterrupted run's tokens); nothing is compiled or
    captured while serving."""
    k = 3
    lm = package_backend(monkeypatch, embedded_checkpoint)
    plain = [r.output_tokens for r in SpeculativeGenerator(lm, None, 0).generate(prompts, 32)]
    served = Served(monkeypatch, tmp_path, embedded_checkpoint, k)
    traces, compiled = set(served.mesh.traces), set(served.model.spec.verify.lm.compiled)
    plan = plan_speculation(vllm_config(k), 3, k)
    runner = ReferenceRunner(RunnerModel(Scheduler(served)), plan, BATCH, 3, [], MAX_SEQ_LEN, served.vocab_size,
                             narrow_verify=narrow_verify)
    outputs = runner.run({0: [(f"r{i}", prompts[i], 32) for i in range(4)]}, {3: ["r1"]})
    assert [outputs[f"r{i}"] for i in range(4) if i != 1] == plain[:1] + plain[2:]
    assert outputs["r1"] == plain_with_recomputes(generator(lm), prompts[1], 32, runner.done["r1"].preempted_at)
    s = runner.stats
    assert s.verify_steps > 0 and (s.plain_steps > 0) != narrow_verify and (s.narrow_verifies > 0) == narrow_verify
    assert s.preemptions == 1 and s.padding_rows > 0
    assert s.multi_token_commits > 0 and s.resumed == 1 and (s.slot_moves > 0 or narrow_verify)  # schedules differ
    assert set(served.mesh.traces) == traces and served.model.spec.verify.lm.compiled == compiled
    assert served.model.spec_decode_metrics() == runner.counters.as_dict()


def test_a_verify_refuses_what_warm_up_did_not_prepare(monkeypatch, tmp_path, embedded_checkpoint):
    """Before warm-up there is no verify program; a page table wider than warm-up's, one whose blocks do not reach a
    row's last position, or another KV cache, is refused (PagedVerify.check, which SpecDecodeCore.verify runs before
    anything changes); a narrower one is padded with -1 as TT pads a prefill's page table (issue 46: it used to be
    refused), giving the full width's ids; only phase 1 (no traces: a launch that does not trace decode) serves its
    verify eagerly with the compiled programs."""
    served = Served(monkeypatch, tmp_path, embedded_checkpoint, 3, trace=False)
    verify = served.model.spec.verify
    assert not verify.lm.traces and verify.lm.compiled == verify.lm.planned
    rows = [UserRows(0, [1, 2], 3)]
    table = torch.zeros(BATCH, served.width, dtype=torch.int32)
    table[:, 0] = torch.arange(1, BATCH + 1)  # each row's first block a real one (block 0 is vLLM's null block)
    with pytest.raises(ValueError, match=f"must be \\[B, <= {served.width}\\]"):
        verify.check(rows, 4, torch.ones(BATCH, served.width + 1, dtype=torch.int32), served.kv_cache)
    with pytest.raises(ValueError, match=f"has no row 0 with 2 blocks: its positions reach {BLOCK} in blocks of "
                                         f"{BLOCK}"):
        verify.check([UserRows(0, [1, 2], BLOCK - 1)], 4, table[:, :1], served.kv_cache)
    verify.check(rows, 4, table[:, :1], served.kv_cache)
    narrow = verify.step(rows, 4, table[:, :1]).ids
    assert narrow == verify.step(rows, 4, table).ids
    with pytest.raises(ValueError, match="not the one the verify was warmed up on"):
        verify.check(rows, 4, table, [list(served.kv_cache[0])])
    with pytest.raises(RuntimeError, match="no verify program for 2 write passes and top 0"):
        verify.check(rows, 0, table, served.kv_cache)
    with pytest.raises(ValueError, match="longer than 1 \\+ K = 4"):
        verify.check([UserRows(0, [1] * 5, 3)], 4, table, served.kv_cache)
    verify.check(rows, 4, table, served.kv_cache)
    out = verify.step(rows, 4, table)  # eager: the compiled program, nothing new
    assert len(out.ids[0]) == 2 and verify.lm.compiled == verify.lm.planned
    fresh = ttnn_model.PagedVerify(verify.tt.model, verify.tt.args, served.mesh, verify.tt.passes, MAX_SEQ_LEN, 3,
                                   verify.tt.config, "performance")
    with pytest.raises(RuntimeError, match="before warmup_model_decode"):
        fresh.check(rows, 4, table, served.kv_cache)


def test_warm_up_names_the_trace_region_first_and_the_plugins_option_when_it_is_outgrown(
        monkeypatch, tmp_path, embedded_checkpoint):
    """Review 46, finding 2: vllm-tt-plugin opens the mesh with a trace region sized for TT's own traces unless
    additional_config["tt"]["trace_region_size"] names one (worker.py@074b07f8 device_params_from_tt_config), and the
    verify's traces come on top. Phase 1 of warm-up, before any capture, logs the region the launch needs and the
    option; a capture that outgrows the region stops with one line naming that option, not the CLI's flag."""
    from loguru import logger

    messages = []
    sink = logger.add(lambda m: messages.append(m.record["message"]), level="INFO")
    try:
        served = Served(monkeypatch, tmp_path, embedded_checkpoint, 3, trace=False)
    finally:
        logger.remove(sink)
    verify = served.model.spec.verify
    assert not served.mesh.traces and not verify.lm.traces  # phase 1: nothing captured yet
    planned = [m for m in messages if m.startswith("speculative verify, K=3: 3 traces planned (write passes "
                                                   "[1, 2, 4])")]
    assert len(planned) == 1, messages
    size = int(re.search(r"the mesh needs about ([0-9]+) B of trace region", planned[0]).group(1))
    assert size > verify.trace_bytes() and planned[0].endswith(
        f"""unless launched with --additional-config '{{"tt": {{"trace_region_size": {size}}}}}')""")
    warm_up = stand_in_tt.Generator.warmup_model_decode

    @functools.wraps(warm_up)  # its signature: the class binds its calls by it
    def tt_warm_up_then_full(self, *args, **kwargs):  # TT's own decode trace fits; the region has no room past it
        result = warm_up(self, *args, **kwargs)
        served.mesh.trace_region_size = sum(served.mesh.trace_sizes.values()) + 1
        return result
    monkeypatch.setattr(stand_in_tt.Generator, "warmup_model_decode", tt_warm_up_then_full)
    with pytest.raises(ValueError, match=r"^the decode traces outgrew the trace region: .* relaunch vLLM with "
                                         r"""--additional-config '\{"tt": \{"trace_region_size": [0-9]+\}\}'$"""):
        served.model.warmup_model_decode(kv_cache=served.kv_cache, enable_trace=True, max_batch_size=BATCH,
                                         num_blocks=served.width, can_sample_on_device=True)


def test_the_serving_docs_trace_region_table_is_trace_plans():
    """Review 46, finding 2: docs/serving.md's per-mesh trace regions for Llama-3.1-8B (32 layers, 128,256 tokens,
    the proposer's top 4, the vocabulary split per device as TT pads it) are trace_plan's numbers, as warm-up logs
    them: TT's own region plus the verify traces' estimate with its margin."""
    import math
    from pathlib import Path

    from models.tt_transformers.ttnn_backend.trace_plan import region_bytes, trace_bytes, trace_keys, tt_trace_region

    text = (Path(__file__).parents[2] / "docs" / "serving.md").read_text()
    for device, n_devices in (("N150", 1), ("N300", 2), ("T3K", 8)):
        share = math.ceil(128256 / (32 * n_devices)) * 32 if n_devices > 1 else 128256
        own = tt_trace_region("Llama-3.1-8B-Instruct", device)
        cells = [device, f"{own / 1e6:.0f} MB"]
        for k in (3, 7):
            verify = sum(trace_bytes("Llama-3.1-8B-Instruct", device, 32, 32, key, share)
                         for key in trace_keys(1 + k, 4, ()) if key.top_k == 4)
            cells += [f"{verify / 1e6:.0f} MB", str(own + region_bytes([verify]))]
        assert f"| {' | '.join(cells)} |" in text, cells


def test_ordered_writes_reach_a_transformer_built_any_way(monkeypatch, tmp_path, embedded_checkpoint):
    """Issue 46, item 4: the ordered cache writes are injected by wrapping TT's Transformer.__init__ (tt/model.py),
    not by replacing generator_vllm's module-level name: a generator_vllm that builds its Transformer by position
    through another import path still gets the ordered-write attention with use_qk_fused False (the old injection
    handed such a builder an attention_class keyword it does not take), TT's class is unwrapped after the build, and a
    builder that brings its own attention_class is refused in one line."""
    import importlib

    def by_position(args, mesh_device, dtype, state_dict, weight_cache_path, use_paged_kv_cache):
        transformer = importlib.import_module("models.tt_transformers.tt.model").Transformer
        return transformer(args, dtype, mesh_device, state_dict, weight_cache_path, None, use_paged_kv_cache)
    install(monkeypatch)
    monkeypatch.setattr(stand_in_generator_vllm, "Transformer", by_position)
    init = stand_in_tt.Transformer.__init__
    served = Served(monkeypatch, tmp_path, embedded_checkpoint, 3, trace=False)
    tt_model = served.model.model[0]
    attention = tt_model.layers[0].attention
    assert type(attention) is not stand_in_tt.Attention and isinstance(attention, stand_in_tt.Attention)
    assert type(attention).__name__ == "Attention" and not tt_model.args.use_qk_fused
    assert stand_in_tt.Transformer.__init__ is init
    own = type("Attention", (stand_in_tt.Attention,), {})
    monkeypatch.setattr(stand_in_generator_vllm, "Transformer",
                        lambda **kwargs: stand_in_tt.Transformer(**kwargs, attention_class=own))
    with pytest.raises(RuntimeError, match="^TT-Transformers built its Transformer with attention_class Attention: "):
        ttnn_model.SpecLlamaForCausalLM.initialize_vllm_model(
            types.SimpleNamespace(_name_or_path=os.environ["HF_MODEL"]), served.mesh, BATCH,
            MAX_SEQ_LEN, n_layers=N_LAYERS, vllm_config=vllm_config(3))
    assert stand_in_tt.Transformer.__init__ is init


def test_spec_plan_refuses_a_galaxy_or_tt_data_parallel_at_configuration_time(monkeypatch):
    """Issue 46, item 4: a Galaxy (MESH_DEVICE TG or BHGLX: the mesh the plugin opens) or a TT data-parallel launch
    (the plugin's tt_data_parallel_size, or the lane count it resolved) is refused by spec_plan, at configuration
    time, in one line, where it used to be refused only when the model loaded; and a TT class that declares the
    decode-reload contract's version 1 is refused there too (this class serves the legacy reload, and says so:
    decode_input_update_contract 0)."""
    install(monkeypatch)
    monkeypatch.setattr(ttnn_model, "_CLASSES", {})
    cls = ttnn_model.SpecLlamaForCausalLM
    assert cls.decode_input_update_contract == 0
    monkeypatch.setenv("MESH_DEVICE", "T3K")
    assert not isinstance(cls.spec_plan(vllm_config(3), BATCH, 3), SpecReject)
    refusals = []
    for mesh in ("TG", "BHGLX"):
        monkeypatch.setenv("MESH_DEVICE", mesh)
        refusals.append(cls.spec_plan(vllm_config(3), BATCH, 3))
    monkeypatch.setenv("MESH_DEVICE", "T3K")
    for additional in ({"tt": {"tt_data_parallel_size": 2}}, {"_tt_resolved_lane_count": 4}):
        config = vllm_config(3)
        config.additional_config = additional
        refusals.append(cls.spec_plan(config, BATCH, 3))
    assert all(isinstance(r, SpecReject) and "\n" not in r.reason for r in refusals)
    assert [r.reason.split(":")[0] for r in refusals[:2]] == ["speculative decoding on a Galaxy is not served yet"] * 2
    assert "tt_data_parallel 2 is not supported" in refusals[2].reason
    assert "tt_data_parallel 4 is not supported" in refusals[3].reason
    monkeypatch.setattr(stand_in_generator_vllm.LlamaForCausalLM, "decode_input_update_contract", 1, raising=False)
    monkeypatch.setattr(ttnn_model, "_CLASSES", {})
    reject = ttnn_model.SpecLlamaForCausalLM.spec_plan(vllm_config(3), BATCH, 3)
    assert isinstance(reject, SpecReject) and "declares decode_input_update_contract = 1" in reject.reason


def test_a_verifys_slot_remap_reaches_tt_transformers_next_decode(monkeypatch, tmp_path, embedded_checkpoint,
                                                                  prompts):
    """Issue 46, item 4: the reload contract has every slot-indexed state moved by a slot_remap exactly once before
    it is read (DECODE_RELOAD_CONTRACT.md@1f10755a); TT's per-slot state (its sampler's, its resident tokens) is read
    by its decode only. A verify that swaps two requests' slots moves the drafter's state, and TT's next decode gets
    that remap (composed with its own: none here) with reset_batch; the decode after it gets none."""
    served = Served(monkeypatch, tmp_path, embedded_checkpoint, 3)
    calls = []
    tt_decode = stand_in_generator_vllm.LlamaForCausalLM.decode_forward

    def recorded(self, *args, **kwargs):
        remap = kwargs.get("slot_remap")
        calls.append((kwargs.get("reset_batch"), None if remap is None else remap.tolist()))
        return tt_decode(self, *args, **kwargs)
    monkeypatch.setattr(stand_in_generator_vllm.LlamaForCausalLM, "decode_forward", recorded)
    scheduler = Scheduler(served)
    chosen = [prompts[0][:40], prompts[1][:35]]
    n = [len(c) for c in chosen]
    first = scheduler.prefill(chosen, [0, 1])
    swap = t([1, 0, 2, 3])  # the two requests trade slots
    tokens, start, num_valid, counts = verify_block([[first[1]], [first[0]]], [n[1], n[0]], 3)
    verified = scheduler.decode(tokens, start, num_valid_drafts=num_valid, accepted_counts=counts,
                                spec_mode=ACCEPT_MODE_ARGMAX_IDS, slot_remap=swap)
    committed, kept = accept_greedy_drafts(verified.argmax_ids, tokens[:, 1:], num_valid)
    positions = torch.full((BATCH, 4), -1, dtype=torch.int32)
    positions[:2, 0] = t([n[1] + 1, n[0] + 1])
    served.model.propose_draft_tokens(3, committed, positions, kept)
    ids = committed[:2, 0].tolist()
    out = scheduler.decode(t([[ids[0]], [ids[1]], [0], [0]]), t([n[1] + 1, n[0] + 1, -1, -1]), read_from_device=True)
    assert calls == [(True, [1, 0, *range(2, 32)])]  # TT's 32 rows: the remap, the rows past B in place
    ids = out[0][:2].tolist()
    committed[:, 1:], committed[:2, 0], positions[:2, 0] = -1, t(ids), t([n[1] + 2, n[0] + 2])
    served.model.propose_draft_tokens(3, committed, positions, torch.ones(BATCH, dtype=torch.int32))
    scheduler.decode(t([[ids[0]], [ids[1]], [0], [0]]), t([n[1] + 2, n[0] + 2, -1, -1]))
    assert calls[-1] == (False, None)
    assert ttnn_model.compose_remaps([1, 0, 2], [0, 2, 1]) == [1, 2, 0]  # row 1 reads what slot 2 held before both


def test_a_request_a_verify_moved_after_its_prefill_gets_its_own_token_from_tt_decode(
        monkeypatch, tmp_path, embedded_checkpoint, prompts):
    """Review 46, finding 6: on reset_batch TT's Generator.decode_forward keeps its device token and position for a
    row whose device position (after the slot_remap) equals the host's or the host's + 1, except for the slots
    prefilled since its last decode, which it excludes by row index after the remap (tt/generator.py@622c6fb9
    l.1237-1300; the slots recorded in prefill_forward_text, l.550-556; mirrored below on the stand-in, whose
    `resident` holds what TT's trace inputs hold). A request A prefilled into the slot of a request X that left,
    moved to another row by a verify's remap, with X's last device position equal to A's, was fed X's token there.
    After a verify the class has TT take the host's inputs in every row."""
    served = Served(monkeypatch, tmp_path, embedded_checkpoint, 3)
    generator = stand_in_tt.Generator
    prefill_text, tt_decode, fed = generator.prefill_forward_text, generator.decode_forward, []

    @functools.wraps(prefill_text)  # its signature: the class binds its calls by it
    def prefill_forward_text(self, tokens, *args, empty_slots=None, **kwargs):  # generator.py:550-556
        prefilled = getattr(self, "_slots_prefilled_since_decode", set())
        self._slots_prefilled_since_decode = prefilled | set(range(tokens.shape[0]) if empty_slots is None
                                                            else [int(s) for s in empty_slots])
        return prefill_text(self, tokens, *args, empty_slots=empty_slots, **kwargs)

    @functools.wraps(tt_decode)
    def decode_forward(self, tokens, start_pos, *args, reset_batch=False, slot_remap=None, **kwargs):
        host_tok, host_pos = tokens.reshape(-1).long(), start_pos.reshape(-1).long()
        merge = (kwargs.get("sampling_params") is not None and kwargs.get("enable_trace", True)
                 and (reset_batch or self.mode != stand_in_tt.Mode.DECODE) and self.resident is not None)
        if merge:  # generator.py:1243-1297, one data-parallel chunk
            dev_tok, dev_pos = (x.long() for x in self.resident)
            if slot_remap is not None:
                remap = torch.as_tensor(slot_remap).long()
                dev_tok, dev_pos = dev_tok[remap], dev_pos[remap]
            use_dev = (dev_pos == host_pos) | (dev_pos == host_pos + 1)
            for slot in getattr(self, "_slots_prefilled_since_decode", ()):
                use_dev[slot] = False
            tokens = torch.where(use_dev, dev_tok, host_tok).to(tokens.dtype).view(tokens.shape)
            start_pos = torch.where(use_dev, dev_pos, host_pos).to(start_pos.dtype).view(start_pos.shape)
        self._slots_prefilled_since_decode = set()  # generator.py:1300
        fed.append((tokens.reshape(-1).tolist(), start_pos.reshape(-1).tolist()))
        return tt_decode(self, tokens, start_pos, *args, reset_batch=reset_batch, slot_remap=slot_remap, **kwargs)
    monkeypatch.setattr(generator, "prefill_forward_text", prefill_forward_text)
    monkeypatch.setattr(generator, "decode_forward", decode_forward)
    scheduler = Scheduler(served)
    x, y = prompts[0][:40], prompts[1][:35]
    first = scheduler.prefill([x, y], [0, 1])
    out = scheduler.decode(t([[first[0]], [first[1]], [0], [0]]), t([40, 35, -1, -1]), read_from_device=True)
    x_token, y_token = out[0][:2].tolist()  # TT's device now holds X's next token at position 41, Y's at 36
    committed, positions = (torch.full((BATCH, 4), -1, dtype=torch.int32) for _ in range(2))
    committed[:2, 0], positions[:2, 0] = t([x_token, y_token]), t([41, 36])
    served.model.propose_draft_tokens(3, committed, positions, torch.ones(BATCH, dtype=torch.int32))
    scheduler.release(0)
    served.model.release_request(0)
    a = prompts[2][:40]  # A in X's slot, verified at 40: its next decode position, 41, is X's device position
    a_first = scheduler.prefill([a], [0])[0]
    swap = t([1, 0, 2, 3])  # the verify moves A to row 1, Y to row 0
    tokens, start, num_valid, counts = verify_block([[y_token], [a_first]], [36, 40], 3)
    verified = scheduler.decode(tokens, start, num_valid_drafts=num_valid, accepted_counts=counts,
                                spec_mode=ACCEPT_MODE_ARGMAX_IDS, slot_remap=swap)
    committed, kept = accept_greedy_drafts(verified.argmax_ids, tokens[:, 1:], num_valid)
    positions = torch.full((BATCH, 4), -1, dtype=torch.int32)
    positions[:2, 0] = t([37, 41])
    served.model.propose_draft_tokens(3, committed, positions, kept)
    ids = committed[:2, 0].tolist()
    assert ids[1] != x_token  # else X's token would be A's by chance
    scheduler.decode(t([[ids[0]], [ids[1]], [0], [0]]), t([37, 41, -1, -1]), read_from_device=True)
    tokens_fed, positions_fed = fed[-1]
    assert (tokens_fed[:2], positions_fed[:2]) == (ids, [37, 41])  # each row its own token, not X's in row 1


def test_the_plugins_rows_pad_to_tt_transformers_tile_and_back():
    """TT's ordinary decode runs the 32-row batch its model is built for: per-row values padded (a fill, or a list's
    or tensor's last row: sampling parameters), a dataclass's per-row fields replaced and its scalars kept, host
    results cut back to the plugin's rows, device results left for TT's own read-back."""
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Params:  # the shape of the plugin's TTSamplingParams after submit_decode's tolist()
        temperature: list
        top_k: torch.Tensor
        seed: int

    assert ttnn_model.pad_rows(t([1, 2]), 4, -1).tolist() == [1, 2, -1, -1]
    assert ttnn_model.pad_rows(t([[1], [2]]), 3, 0).tolist() == [[1], [2], [0]]
    assert ttnn_model.pad_rows([0.5, 0.0], 4, None) == [0.5, 0.0, 0.0, 0.0]
    padded = ttnn_model.pad_sampling_params(Params([0.0, 1.0], t([1, 5]), 7), 2, 4)
    assert padded.temperature == [0.0, 1.0, 1.0, 1.0] and padded.top_k.tolist() == [1, 5, 5, 5] and padded.seed == 7
    assert ttnn_model.pad_sampling_params(None, 2, 4) is None
    assert ttnn_model.first_rows(torch.arange(32), 4).tolist() == [0, 1, 2, 3]
    ids, probs = ttnn_model.first_rows((torch.zeros(32, 1, 8), None), 4)
    assert tuple(ids.shape) == (4, 1, 8) and probs is None
    device_out = object()
    assert ttnn_model.first_rows(device_out, 4) is device_out


@pytest.mark.parametrize("regular", [True, False], ids=["regular-packages", "namespace-packages"])
def test_bundle_classes_resolve_beside_tt_metal(tmp_path, regular):
    """As the plugin's lazy registration resolves a bundle's main_class (import the module, getattr the class) in a
    process with this repository and a tt-metal tree on PYTHONPATH (ours first, tests/tt_metal_tree.py's fake
    tree, regular or namespace packages, with a generator_vllm.py holding LlamaForCausalLM and MistralForCausalLM):
    the classes subclass tt-metal's."""
    from ..conftest import REPO_ROOT
    from ..tt_metal_tree import fake_tt_metal, run

    tt_metal = fake_tt_metal(tmp_path / "tt-metal", regular)
    (tt_metal / "models/tt_transformers/tt/generator_vllm.py").write_text(
        "class Generator:\n    pass\n\n\nclass LlamaForCausalLM(Generator):\n"
        "    model_capabilities = {'supports_prefix_caching': True}\n\n\nclass MistralForCausalLM(Generator):\n"
        "    model_capabilities = {}\n")
    probe = ("import importlib, json, pathlib, sys; from models.tt_transformers.serving import ttnn_model; "
             "folder = pathlib.Path(sys.argv[1]); ttnn_model.write_model_bundles(folder); "
             "out = {}\n"
             "for meta in sorted(folder.glob('*/vllm_metadata.json')):\n"
             "    data = json.loads(meta.read_text()); module, name = data['main_class'].split(':')\n"
             "    cls = getattr(importlib.import_module(module), name)\n"
             "    out['TT' + data['arch']] = [c.__module__ for c in cls.__mro__[1:3]] + [cls.model_capabilities.get("
             "'supports_prefix_caching'), cls.model_capabilities['supports_spec_decode']]\n"
             "print(json.dumps(out))")
    out = run(["-c", probe, str(tmp_path / "bundles")], [REPO_ROOT, tt_metal])
    assert out.returncode == 0, out.stderr[-2000:]
    import json

    assert json.loads(out.stdout.strip().splitlines()[-1]) == {
        "TTLlamaForCausalLM": ["models.tt_transformers.serving.ttnn_model", "models.tt_transformers.tt.generator_vllm",
                               True, True],
        "TTMistralForCausalLM": ["models.tt_transformers.serving.ttnn_model",
                                 "models.tt_transformers.tt.generator_vllm", None, True]}


def two_prefilled(monkeypatch, served, embedded_checkpoint, prompts):
    """Two requests (40 and 35 prompt tokens) prefilled into slots 0 and 1 through the scheduler, and the same into
    the package's own backend (whose steps the served ids are compared with): the scheduler, the prompt lengths, the
    served first tokens and that backend."""
    scheduler = Scheduler(served)
    chosen = [prompts[0][:40], prompts[1][:35]]
    first = scheduler.prefill(chosen, [0, 1])
    lm = package_backend(monkeypatch, embedded_checkpoint)
    for user, prompt in enumerate(chosen):
        lm.prefill(user, prompt)
    return scheduler, [len(c) for c in chosen], first, lm


def test_refused_decodes_move_nothing(monkeypatch, tmp_path, embedded_checkpoint, prompts):
    """TT's ordinary decode and the verify, each carrying a slot_remap that swaps two requests, refused for what the
    step would refuse or write wrongly: a page table without a live row's row, a live row's block 0 (vLLM's null
    block), one out of the pool, two rows writing the same block (contract.check_page_table, which the torch class
    checks too), another KV cache, int64 tokens, a column short (the decode; a verify pads it); and a verify of more
    rows than the 32-row tile. Each raises one ValueError before the drafter moves: the correct call after them gives
    the package's own step's ids."""
    served = Served(monkeypatch, tmp_path, embedded_checkpoint, 3)
    verify, model = served.model.spec.verify, served.model
    scheduler, n, first, lm = two_prefilled(monkeypatch, served, embedded_checkpoint, prompts)
    swap = t([1, 0, 2, 3])
    greedy = stand_in_tt.SamplingParams(temperature=0.0, top_k=1, top_p=1.0)

    def refused(tokens, start_pos, good, **kwargs):
        """Each spoiled copy of the call raises, before anything moves."""
        last = good[:, 0].clone()
        last[0] = served.num_blocks
        cases = {"has no row 1": (tokens, good[:1]),
                 "block 0 is vLLM's null block": (tokens, torch.cat([good[:, :1] * 0, good[:, 1:]], 1)),
                 "must be a distinct block in \\[1, 33\\)": (tokens, torch.cat([last[:, None], good[:, 1:]], 1)),
                 "rows [01] and [01] both hold blocks": (tokens, torch.cat([good[:1], good[:1], good[2:]])),
                 "must be int32, got torch.int64": (tokens.to(torch.int64), good)}
        if "spec_mode" not in kwargs:  # a verify pads a narrower page table (test_a_verify_refuses_what_warm_up...)
            cases["must be \\[B, 8\\]"] = (tokens, good[:, :-1])
        for message, (spoiled, table) in cases.items():
            with pytest.raises(ValueError, match=message):
                model.decode_forward(tokens=spoiled, start_pos=start_pos, page_table=table, kv_cache=served.kv_cache,
                                     slot_remap=swap, enable_trace=True, reset_batch=True, **kwargs)
        with pytest.raises(ValueError, match="kv_cache is not the one the .* was warmed up on"):
            model.decode_forward(tokens=tokens, start_pos=start_pos, page_table=good,
                                 kv_cache=[served.kv_cache[0][:1]], slot_remap=swap, enable_trace=True,
                                 reset_batch=True, **kwargs)

    # TT's ordinary decode: row 0 takes the request slot 1 held, row 1 slot 0's
    tokens, start_pos = t([[first[1]], [first[0]], [0], [0]]), t([n[1], n[0], -1, -1])
    refused(tokens, start_pos, scheduler.table([1, 0, 2, 3]), sampling_params=greedy, read_from_device=True)
    out = scheduler.decode(tokens, start_pos, slot_remap=swap, read_from_device=True)
    ids = out[0][:2].tolist()
    assert [[i] for i in ids] == lm.step([UserRows(1, [first[1]], n[1]), UserRows(0, [first[0]], n[0])]).ids
    committed, positions = (torch.full((BATCH, 4), -1, dtype=torch.int32) for _ in range(2))
    committed[:2, 0], positions[:2, 0] = t(ids), t([n[1] + 1, n[0] + 1])
    model.propose_draft_tokens(3, committed, positions, torch.ones(BATCH, dtype=torch.int32))
    # a verify swapping them back: row 0 holds slot 0's first request again
    tokens, start, num_valid, counts = verify_block([[ids[1], 7], [ids[0], 7]], [n[0] + 1, n[1] + 1], 3)
    side = dict(num_valid_drafts=num_valid, accepted_counts=counts, spec_mode=ACCEPT_MODE_ARGMAX_IDS)
    refused(tokens, start, scheduler.table([1, 0, 2, 3]), **side)
    top_k = served.model.spec.core.proposer.top_k
    many = torch.zeros(9, served.width, dtype=torch.int32)
    many[:, 0] = torch.arange(1, 10)
    with pytest.raises(ValueError, match="a step of 36 rows does not fit the decode tile \\(32\\)"):
        verify.check([UserRows(u, [1] * 4, 3) for u in range(9)], top_k, many, served.kv_cache)
    assert served.model.spec_decode_metrics()[NUM_DRAFTS] == 0
    out = scheduler.decode(tokens, start, slot_remap=swap, **side)
    ref = lm.step([UserRows(0, [ids[1], 7], n[0] + 1), UserRows(1, [ids[0], 7], n[1] + 1)]).ids
    assert out.argmax_ids[:2, :2].tolist() == ref


def test_a_prompt_tt_pads_past_max_model_len_is_served(monkeypatch, tmp_path, embedded_checkpoint, prompts):
    """At max_model_len 256 (MAX_SEQ_LEN) TT pads a prompt over 128 tokens to 1,024 (tt/common.py
    get_padded_prefill_len), past a ModelArgs sized 256 (tt/model.py prepare_inputs_prefill asserts it fits the rotary
    tables): the speculating class sizes ModelArgs as the demo does (model_args_seq_len), so a 200-token prompt
    prefills through TT's prefill_forward_text, and its first token and a verify after it are the package's own."""
    served = Served(monkeypatch, tmp_path, embedded_checkpoint, 3, trace=False)
    long = [token for prompt in prompts for token in prompt][:200]
    assert len(long) == 200
    scheduler = Scheduler(served)
    first = scheduler.prefill([long], [0])
    lm = package_backend(monkeypatch, embedded_checkpoint)
    assert [first] == lm.prefill(0, long).ids
    tokens, start, num_valid, counts = verify_block([[first[0], 7, 8]], [len(long)], 3)
    out = scheduler.decode(tokens, start, num_valid_drafts=num_valid, accepted_counts=counts,
                           spec_mode=ACCEPT_MODE_ARGMAX_IDS)
    assert out.argmax_ids[0, :3].tolist() == lm.step([UserRows(0, [first[0], 7, 8], len(long))], top_k=4).ids[0]
