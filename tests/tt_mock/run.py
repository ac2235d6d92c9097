# SPDX-License-Identifier: Apache-2.0
"""`make tt-mock`: every ttnn call the project makes, through the real ttnn 0.81.1 on tt-metal's Mock Device (a mock
N150, mock N300 1x2 and T3K 1x8 meshes with FABRIC_1D, and a mock Galaxy 8x4 (32 Wormhole chips, MESH_DEVICE TG)
with FABRIC_1D_RING, as a 6U Galaxy runs; a model runs on the meshes its KV heads split over), eagerly (`--trace 0`:
the Mock Device cannot capture traces).

The backend is built as the demo builds it (device.open_mesh, model.build_tt_model, TtnnCausalLM, TtnnDraftHead)
over tests/tt_mock/tt_transformers.py (a TEST DOUBLE of TT-Transformers on real ttnn tensors), at the shapes of
Llama-3.1-8B-Instruct (dim 4096, 32 heads, 8 KV heads, vocabulary 128,256, a random EAGLE-3 head with a 32k draft
vocabulary; max_seq_len 1024 at batch 32 and 8192 at batch 4, the second through the older ttnn_decode_forward
form) and of the embedded SmolLM2-135M-Instruct, and every program a run uses runs: the decode step at each
write-pass count with and without the top k and the taps (the tap copies, their gather on the mesh, the tap tile),
the split-vocabulary argmax, max and top k per device, the inputs' host-to-device writes, TT's prefill (chunked past
the mock N150's 4k chunk: the warm-up's chunked lengths and a long prompt, through zero-padded page tables), the
prompt taps' reads, and the device draft head's feed and chain (its weights, paged KV cache, draft-id embedding and
outputs, a feed-only replay), and the serving class's verify (serving/ttnn_model.py) on a KV cache allocated as
TT-Transformers' vLLM adapter allocates vLLM's, with a scheduler's page table staged each step. The double runs
TT-Transformers' attention ops (paged SDPA decode over each verify row's position, paged_fill_cache, chunked and causal
SDPA) on the real ttnn as well. Readback is all zeros there: the ids
are not checked, the calls are.

On the Galaxy the model runs as make tt-smoke and the demo run it, on the first of TT's data-parallel 1 x 8
submeshes (device.model_mesh: tt/generator.py create_submeshes(mesh, 4)), over the double and over the real tree; a
model tensor-parallel over the whole mesh is refused in one line (device.check_tensor_parallel), as is a speculative
serving launch.

The same backend also runs over tt-metal's REAL TT-Transformers where a tree is at hand (real_tree.py: $TT_METAL_HOME,
else ../shared/reference/tt-metal-622c6fb9; skipped with the reason otherwise): Llama-3.1-8B's shapes with TT's dummy
weights and the embedded SmolLM2 with its real weights, on N150, N300 1x2, T3K 1x8 and a 1 x 8 submesh of the Galaxy.

Each mesh runs in its own process (the mock cluster is chosen by an environment variable before ttnn loads). A call
is counted where the project's own code (models/tt_transformers) makes it; the double's calls are reported apart.
Prints one line per case and ends with `tt-mock: <n> calls through ttnn 0.81.1 on mock N150, N300 1x2, T3K 1x8 and
Galaxy 8x4, <f> failures`; exit status 1 on any failure.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PROJECT = str(REPO / "models" / "tt_transformers")
MESHES = {"N150": ("wormhole_N150.yaml", (1, 1)), "N300": ("wormhole_N300.yaml", (1, 2)),
          "T3K": ("wormhole_T3K.yaml", (1, 8)), "Galaxy": ("wormhole_galaxy.yaml", (8, 4))}
# The MESH_DEVICE a mesh opens as (device.MESH_SHAPES, from tt-metal's own table): its name, but TG for the Wormhole
# Galaxy (8 x 4)
MESH_DEVICE = {"Galaxy": "TG"}
# HF config.json fields the double's ModelArgs and our torch ModelArgs read
LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
            "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "vocab_size": 128256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072,
            "tie_word_embeddings": False, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0,
                                                            "high_freq_factor": 4.0,
                                                            "original_max_position_embeddings": 8192,
                                                            "rope_type": "llama3"}}
SMOLLM2 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
           "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
           "vocab_size": 49152, "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "max_position_embeddings": 8192,
           "tie_word_embeddings": True}
# (model name, config, max_seq_len, batch size, draft vocabulary of the random head, the double's ttnn_decode_forward:
# "C" on_device_logits, "A/B" sampling_on_device + capture_sampling_trace)
SHAPES = [("Llama-3.1-8B-Instruct", LLAMA_8B, 1024, 32, 32000, "C"),
          ("Llama-3.1-8B-Instruct", LLAMA_8B, 8192, 4, 32000, "A/B"),
          ("SmolLM2-135M-Instruct", SMOLLM2, 1024, 4, None, "C")]
N_DRAFT = 4
# (model name, config, max_model_len, K) of the serving class's verify cases (serving_verify)
SERVING = [("Llama-3.1-8B-Instruct", LLAMA_8B, 1024, 7), ("SmolLM2-135M-Instruct", SMOLLM2, 1024, 3)]


class CallCounter:
    """Wraps ttnn's callables to count the calls made from the project's code and, apart, from the double or from
    tt-metal's real TT-Transformers (`tree`: its root; models/tt_transformers and models/common)."""

    def __init__(self, tree: Optional[Path] = None):
        self.ours, self.double = Counter(), Counter()
        self.tree = str(tree) if tree is not None else None

    def install(self, ttnn) -> None:
        for module in (ttnn, ttnn.experimental, ttnn.transformer):
            for name in dir(module):
                fn = getattr(module, name)
                if name.startswith("_") or isinstance(fn, type) or not callable(fn) or \
                        type(fn).__name__ == "module":
                    continue
                setattr(module, name, self._wrap(f"{module.__name__}.{name}", fn))

    def _wrap(self, name, fn):
        def counted(*args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(PROJECT):
                self.ours[name] += 1
            elif self.tree is None or caller.startswith(self.tree):
                self.double[name] += 1
            return fn(*args, **kwargs)
        counted.__wrapped__ = fn
        counted.__doc__ = fn.__doc__
        return counted


def install_double() -> None:
    """models.tt_transformers.tt.* (and models.common.lightweightmodule) resolve to the double."""
    from tests.tt_mock import tt_transformers

    for name in ("models.tt_transformers.tt", "models.tt_transformers.tt.common", "models.tt_transformers.tt.model",
                 "models.tt_transformers.tt.model_config", "models.tt_transformers.tt.attention",
                 "models.tt_transformers.tt.generator", "models.tt_transformers.tt.ccl",
                 "models.common", "models.common.lightweightmodule"):
        sys.modules[name] = tt_transformers


def checkpoint(folder: Path, name: str, config: dict) -> Path:
    path = folder / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def run_shape(mesh, name: str, config: dict, max_seq_len: int, batch: int, draft_vocab, form: str, work: Path) -> None:
    """One model shape: the target (its double's ttnn_decode_forward of the given form) through every program the
    demo plans, TT's prefill, chunked past the device's chunk size (the warm-up's every chunked length and a long
    prompt), a prompt's taps, a verify step of several users, then the device draft head fed the prompt and a verified
    step, drafting chains."""
    import torch

    from models.tt_transformers.checkpoints.eagle3_format import random_head
    from models.tt_transformers.checkpoints.model_shape import ModelShape
    from models.tt_transformers.ttnn_backend.eagle3_head import TtnnDraftHead
    from models.tt_transformers.ttnn_backend.causal_lm import TtnnCausalLM
    from models.tt_transformers.ttnn_backend.traces import MeshTraces
    from models.tt_transformers.ttnn_backend.model import build_tt_model
    from tests.tt_mock import tt_transformers

    folder = checkpoint(work, name, config)
    built = tt_transformers.Transformer
    tt_transformers.Transformer = {"C": built, "A/B": tt_transformers.TransformerAB}[form]
    try:
        tt = build_tt_model(mesh, folder, name, batch, max_seq_len, True)
    finally:
        tt_transformers.Transformer = built
    lm = TtnnCausalLM(tt, batch, max_seq_len, mesh_traces=MeshTraces(mesh), trace=False)
    args = ModelShape.from_hf_config(config)
    head_config, weights = random_head(args, draft_vocab=draft_vocab)
    lm.warm_up(N_DRAFT + 1, 4, head_config.taps)  # the steps a hybrid run plans: recycling's top k, the head's taps
    embedding = torch.zeros(config["vocab_size"], config["hidden_size"], dtype=torch.bfloat16)
    head = TtnnDraftHead(lm, head_config, weights, embedding, N_DRAFT, args, cache_dir=work / "head" / name)
    try:
        exercise(lm, head, head_config.taps, config["hidden_size"])
    finally:
        head.release()
        lm.release()


def exercise(lm, head, taps, dim: int) -> None:
    from models.tt_transformers.speculative.backend import UserRows
    from models.tt_transformers.speculative.drafters.eagle3_device import HeadFeed

    head.warm_up()
    lm.prepare_traces()  # eager: every planned program of the target and the head runs once
    users = list(range(min(lm.max_batch_size, 3)))
    chunk = lm.tt.args.max_prefill_chunk_size
    if chunk < lm.max_seq_len - N_DRAFT - 2:  # a prompt TT prefills in chunks, its taps read back chunk by chunk
        long = [i % 1000 for i in range(chunk + 100)]
        assert lm.prefill(users[-1], long, taps=taps).hidden[0].shape == (len(long), len(taps) * dim)
    prompt = list(range(1, 41))
    for user in users:
        out = lm.prefill(user, prompt, taps=taps)
        assert out.hidden[0].shape == (len(prompt), len(taps) * dim)
    drafted = head.draft([HeadFeed(u, 0, prompt[1:] + [7], states=out.hidden[0]) for u in users], users, N_DRAFT)
    rows = [UserRows(u, [7] + drafted[u][0], len(prompt)) for u in users]
    step = lm.step(rows, logits=True, top_k=4, taps=taps)
    feeds = [HeadFeed(r.user, r.start_pos, ids[: len(r.tokens)], tile_rows=range(h.first_row, h.first_row + len(r.tokens)))
             for r, ids, h in zip(rows, step.ids, step.hidden)]
    head.draft(feeds, users, N_DRAFT)
    head.draft(feeds, [], 0)  # a feed-only replay (the hybrid's step that drafts nothing from the head)
    lm.tap_gather = "host"  # --tap_gather host: the same eager program, the tap tile written through the host
    lm.step(rows, taps=taps)
    lm.step([UserRows(0, [3], len(prompt) + N_DRAFT + 1)])  # a plain decode step


def refused(call, message: str) -> None:
    """`call` raises ValueError with the one line `message` begins (a refusal by design, not a failure)."""
    try:
        call()
    except ValueError as e:
        if not str(e).startswith(message) or "\n" in str(e):
            raise AssertionError(f"refused with another message: {e!r} (expected one line from {message!r})") from e
        return
    raise AssertionError(f"not refused: expected {message!r}")


def galaxy_refused(mesh, work: Path) -> None:
    """Llama-3.1-8B tensor-parallel over the whole Galaxy: refused in one line before TT-Transformers builds anything
    (device.check_tensor_parallel: TT's own path there fails TT's checks; the model runs on a 1 x 8 submesh instead,
    device.model_mesh)."""
    from models.tt_transformers.ttnn_backend.model import build_tt_model

    name = "Llama-3.1-8B-Instruct"
    refused(lambda: build_tt_model(mesh, checkpoint(work, name, LLAMA_8B), name, 32, 1024, True),
            f"mesh_device: a {' x '.join(map(str, tuple(mesh.shape)))} Galaxy mesh: ")  # 4 x 8 once TT's split ran


def serving_refused(mesh) -> None:
    """The serving class on a Galaxy with a speculative config: refused in one line before anything is built
    (serving/ttnn_model.py SpecDecodeModel.initialize_vllm_model), over a stand-in for TT-Transformers' vLLM class
    with its initialize_vllm_model signature (generator_vllm.py) that records whether it was called."""
    from types import SimpleNamespace

    from models.tt_transformers.serving.contract import MODEL_OWNED_DRAFTER
    from models.tt_transformers.serving.ttnn_model import SpecDecodeModel

    built = []

    class TTClass:
        @classmethod
        def initialize_vllm_model(cls, hf_config, mesh_device, max_batch_size, max_seq_len, n_layers=None,
                                  tt_data_parallel=1, optimizations="performance"):
            built.append(mesh_device)

    speculative = SimpleNamespace(method="custom_class", model=MODEL_OWNED_DRAFTER, num_speculative_tokens=7)
    vllm_config = SimpleNamespace(speculative_config=speculative,
                                  scheduler_config=SimpleNamespace(max_num_seqs=4),
                                  model_config=SimpleNamespace(max_model_len=1024))
    cls = type("SpecLlamaForCausalLM", (SpecDecodeModel, TTClass), {})
    refused(lambda: cls.initialize_vllm_model(SimpleNamespace(_name_or_path="Llama-3.1-8B-Instruct"), mesh, 4, 1024,
                                              vllm_config=vllm_config),
            "speculative decoding on a Galaxy is not served yet: ")
    assert not built, "TT-Transformers' class was built before the refusal"


VLLM_BLOCK = 64  # vLLM's KV block size on TT (the plugin's default --block_size)


def serving_verify(mesh, name: str, config: dict, max_seq_len: int, k: int, work: Path) -> None:
    """paged_verify over the double's model of the shape (all its layers)."""
    from models.tt_transformers.ttnn_backend.model import build_tt_model

    paged_verify(build_tt_model(mesh, checkpoint(work, name, config), name, 32, max_seq_len, True), max_seq_len, k,
                 work, buffers=1)


def allocate_vllm_kv_cache(kv_cache_shape, dtype, num_layers: int, dp_model, tt_cache_path: Path, buffers: int):
    """tt/generator_vllm.py allocate_vllm_kv_cache (622c6fb9, through allocate_vllm_kv_cache_per_layer; that module
    imports vLLM, which the ttnn venv lacks): per data-parallel model, per distinct buffer (tensor_idx), [k, v] of
    ttnn.as_tensor(torch.zeros(kv_cache_shape, dtype=dtype), device=submesh, mesh_mapper=ReplicateTensorToMesh,
    layout=TILE, memory_config=DRAM, dtype=bfloat8_b (the performance preset's KV_CACHE, tt/model_config.py),
    cache_file_name=tt_cache_path / f"empty_{kv}cache_paged_attention{shape}_t{tensor_idx}"), layer i on buffer
    i % buffers. TT gives every layer its own (buffers = num_layers); the double's layers share one (its own caches
    do too: 32 layers of an 8B cache would not fit the mock device's DRAM, and each layer's calls are the same)."""
    import torch
    import ttnn

    kv_cache = []
    for model in dp_model:
        submesh = model.mesh_device
        pairs = [[ttnn.as_tensor(torch.zeros(kv_cache_shape, dtype=dtype), device=submesh,
                                 mesh_mapper=ttnn.ReplicateTensorToMesh(submesh), layout=ttnn.TILE_LAYOUT,
                                 memory_config=ttnn.DRAM_MEMORY_CONFIG, dtype=ttnn.bfloat8_b,
                                 cache_file_name=Path(tt_cache_path) / f"empty_{kv}cache_paged_attention"
                                                                       f"{tuple(kv_cache_shape)}_t{i}")
                  for kv in ("k", "v")] for i in range(buffers)]
        kv_cache.append([pairs[i % buffers] for i in range(num_layers)])
    return kv_cache


def paged_verify(tt, max_seq_len: int, k: int, work: Path, buffers: Optional[int] = None) -> None:
    """The serving class's verify (serving/ttnn_model.py PagedVerify) over a built model, on a KV cache allocated as
    TT-Transformers' vLLM adapter allocates vLLM's (allocate_vllm_kv_cache: [blocks, kv heads / devices, 64, head_dim]
    bfloat8_b, replicated; `buffers` distinct layer buffers, default one a layer), warmed for K (every write-pass count
    of pass_ladder(1 + K) compiled), then two verify steps of 32 // (1 + K) requests, each with the page table a
    scheduler would send (shuffled blocks, grown between the steps; max_model_len / 64 blocks a row, as the runner's
    warm-up passes num_blocks), staged into the persistent page-table input, the rows' chains from 1 to 1 + K long
    across a block boundary. Eager (trace False)."""
    import random

    import torch

    from models.tt_transformers.serving.ttnn_model import PagedVerify
    from models.tt_transformers.speculative.backend import UserRows

    users, width = 32 // (1 + k), -(-max_seq_len // VLLM_BLOCK)
    heads = tt.config.n_kv_heads // tt.mesh_device.get_num_devices()
    blocks = users * width + 1  # block 0: vLLM's null block
    folder = work / "vllm_cache" / tt.args.model_name
    folder.mkdir(parents=True, exist_ok=True)
    kv_cache = allocate_vllm_kv_cache((blocks, heads, VLLM_BLOCK, tt.config.head_dim), torch.bfloat16,
                                      tt.args.n_layers, [tt.model], folder, buffers or tt.args.n_layers)
    verify = PagedVerify(tt.model, tt.args, tt.mesh_device, tt.passes, max_seq_len, k, tt.config, tt.optimizations)
    try:
        verify.warm(kv_cache, width, 4, trace=False)
        free = list(range(1, blocks))
        random.Random(0).shuffle(free)
        tables = {u: [free.pop()] for u in range(users)}
        for start in (VLLM_BLOCK - 2, VLLM_BLOCK + 3):  # the first step's longer chains cross into a second block
            rows = [UserRows(u, [7] * (1 + (u + k) % (1 + k)), start) for u in range(users)]
            for r in rows:
                while len(tables[r.user]) * VLLM_BLOCK < r.start_pos + len(r.tokens):
                    tables[r.user].append(free.pop())
            table = torch.zeros(users, width, dtype=torch.int32)
            for u, owned in tables.items():
                table[u, : len(owned)] = torch.tensor(owned, dtype=torch.int32)
            verify.check(rows, 4, table, kv_cache)  # what SpecDecodeCore.verify runs before anything changes
            out = verify.step(rows, 4, table)
            assert [len(ids) for ids in out.ids] == [len(r.tokens) for r in rows]
    finally:
        verify.release()


def negative_control(mesh) -> None:
    """A call ttnn must refuse (a matmul whose inner dims differ): if it passes, the mock device is not validating and
    nothing else this run reports means anything."""
    import torch
    import ttnn

    def tile(*shape):
        return ttnn.from_torch(torch.zeros(*shape), dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=mesh,
                               mesh_mapper=ttnn.ReplicateTensorToMesh(mesh))
    try:
        ttnn.linear(tile(1, 1, 32, 64), tile(32, 32))
    except RuntimeError as e:
        if "width of the first tensor must be equal to the height of the second" in str(e):
            return
        raise AssertionError(f"the refusal came with another message: {e}") from e
    raise AssertionError("ttnn.linear of [32, 64] by [32, 32] was accepted: the mock device is not validating")


def bfp8_storage() -> None:
    """ttnn_backend/bfp8.py's reference of bfloat8_b storage against ttnn's own host conversion, value for value:
    random values over six decades, a non-tile shape, a batch of matrices, and ties (round half to even, clamped)."""
    import torch
    import ttnn

    from models.tt_transformers.ttnn_backend.bfp8 import bfp8_round

    torch.manual_seed(0)
    ties = torch.zeros(32, 32)
    ties[:, 0] = 64.0  # the block's exponent 6: a step of 1
    ties[:, 1:16] = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, 126.5, 127.5, -127.5, 0.25, 0.75, 5.5, 6.5, 7.5])
    cases = [torch.randn(96, 128) * torch.logspace(-4, 2, 128), torch.randn(50, 70), torch.randn(3, 64, 32) * 1e-3,
             ties]
    for x in cases:
        device = ttnn.to_torch(ttnn.from_torch(x, dtype=ttnn.bfloat8_b, layout=ttnn.TILE_LAYOUT)).float()
        ours = bfp8_round(x)
        if not torch.equal(ours, device.reshape(ours.shape)):
            differ = (ours != device.reshape(ours.shape)).sum().item()
            raise AssertionError(f"bfp8_round differs from ttnn's bfloat8_b in {differ} of {x.numel()} values "
                                 f"(shape {list(x.shape)})")


def on_mesh(shapes: list, mesh) -> list:
    """The shapes whose KV heads split evenly over the mesh's devices: TT-Transformers' attention gives each device
    n_kv_heads // num_devices of them (SmolLM2's 3 do not split over a T3K's 8; real ttnn's SDPA refuses the 0 left,
    sdpa_device_operation.cpp: nkv > 0 && nqh >= nkv && nqh % nkv == 0)."""
    devices = mesh.get_num_devices()
    return [shape for shape in shapes if shape[1]["num_key_value_heads"] % devices == 0]


def mesh_env(mesh_name: str, jit: str, tree: Optional[Path] = None) -> dict:
    """The environment a mesh's worker runs in: the mock cluster (chosen before ttnn loads), the JIT cache, and with
    `tree` tt-metal's models on the path after ours (real_tree.py)."""
    return {"ARCH_NAME": "wormhole_b0", "TT_METAL_MOCK_CLUSTER_DESC_PATH": str(HERE / MESHES[mesh_name][0]),
            "TT_METAL_CACHE": os.environ.get("TT_METAL_CACHE", jit + "/"),
            "PYTHONPATH": os.pathsep.join(map(str, [REPO] + ([tree] if tree else []))),
            "TT_METAL_LOGGER_LEVEL": os.environ.get("TT_METAL_LOGGER_LEVEL", "WARNING")}


def worker(mesh_name: str, out: Path, real: bool = False) -> int:
    """The cases on one mock mesh (real: over tt-metal's real TT-Transformers, real_tree.py; else over the double);
    a JSON summary written to `out` (tt-metal logs to stdout). Run by hand (`--mesh NAME --summary FILE [--real]`, no
    mock cluster set) it sets its mesh's environment itself, the JIT cache in a temporary folder removed when it exits
    unless TT_METAL_CACHE names one."""
    from tests.tt_mock import real_tree

    tree = real_tree.source()[0] if real else None
    if "TT_METAL_MOCK_CLUSTER_DESC_PATH" not in os.environ:
        jit = None if "TT_METAL_CACHE" in os.environ else tempfile.TemporaryDirectory(prefix="tt-mock-jit-")
        os.environ.update(mesh_env(mesh_name, jit.name if jit else "", tree))
        sys.path[1:1] = [str(tree)] if tree else []  # after ours, before anything imports models
    import ttnn

    from models.tt_transformers.ttnn_backend import device
    from tests.tt_mock import primitives

    counter = CallCounter(tree)
    counter.install(ttnn)
    embedded = real_tree.embedded_folder() if real else None  # under the caller's TT_CACHE_PATH, moved below
    if not real:
        install_double()
    device.tt_device_present = lambda: True  # the mock device stands in for /dev/tenstorrent*
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["TT_CACHE_PATH"] = tmp
        name_as = MESH_DEVICE.get(mesh_name, mesh_name)
        assert device.mesh_shape(name_as) == MESHES[mesh_name][1], (name_as, device.mesh_shape(name_as))
        with device.open_mesh(name_as, trace_region_size=50_000_000) as mesh:
            galaxy = tuple(mesh.shape) == (8, 4)
            if real:
                run_cases(real_tree.cases(mesh_name, mesh, Path(tmp), embedded), counter, results)
                return write_summary(out, mesh_name, results, counter, real)
            # as make tt-smoke and the demo: on a Galaxy TT's first 1 x 8 submesh, and nothing runs on the Galaxy
            # itself (ttnn 0.81.1 would refuse to close the submesh, device.open_mesh)
            model = device.model_mesh(mesh)
            cases = [(f"{mesh_name} negative control (a refused matmul)", partial(negative_control, model)),
                     (f"{mesh_name} bfloat8_b storage (bfp8_round = ttnn's host conversion)", bfp8_storage),
                     (f"{mesh_name} speculative primitives (measured, not adopted)",
                      partial(primitives.measure, model))]
            if galaxy:
                cases.append((f"{mesh_name} Llama-3.1-8B-Instruct tensor-parallel over the whole mesh (refused)",
                              partial(galaxy_refused, mesh, Path(tmp))))
            on = f" on a {' x '.join(map(str, tuple(model.shape)))} submesh" if galaxy else ""
            # the Galaxy's submesh runs the T3K's model: its first shape (the demo's 8B at batch 32), not the T3K's
            # second (the older decode form, the same programs on the same 1 x 8 mesh), keeps CI within its time
            for name, config, max_seq_len, batch, draft_vocab, form in on_mesh(SHAPES, model)[: 1 if galaxy else None]:
                cases.append((f"{mesh_name} {name}{on} max_seq_len {max_seq_len} batch {batch}, decode form {form}",
                              partial(run_shape, model, name, config, max_seq_len, batch, draft_vocab, form,
                                      Path(tmp))))
            if galaxy:
                cases.append((f"{mesh_name} serving with a speculative config (refused on a Galaxy)",
                              partial(serving_refused, mesh)))
            for name, config, max_seq_len, k in (() if galaxy else on_mesh(SERVING, mesh)):
                cases.append((f"{mesh_name} {name} serving verify on vLLM's cache (blocks of {VLLM_BLOCK}), K={k}",
                              partial(serving_verify, mesh, name, config, max_seq_len, k, Path(tmp))))
            run_cases(cases, counter, results)
    return write_summary(out, mesh_name, results, counter, real)


def run_cases(cases: list, counter: CallCounter, results: list) -> None:
    """Each (name, call) run, its calls counted (ours and the double's or TT's), its failure recorded."""
    for case, run in cases:
        before, start, notes = sum(counter.ours.values()), time.perf_counter(), None
        theirs = sum(counter.double.values())
        try:
            notes = run()  # a measurement's findings, one line each (the checks return None)
            error = None
        except Exception as e:  # noqa: BLE001: a validation error is the finding
            error = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        results.append({"case": case, "calls": sum(counter.ours.values()) - before,
                        "their_calls": sum(counter.double.values()) - theirs, "error": error,
                        "seconds": round(time.perf_counter() - start, 1), "notes": notes or []})


def write_summary(out: Path, mesh_name: str, results: list, counter: CallCounter, real: bool) -> int:
    out.write_text(json.dumps({"mesh": mesh_name, "real": real, "results": results, "ours": dict(counter.ours),
                               "double": sum(counter.double.values())}))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mesh", choices=list(MESHES), help="run one mesh's cases in this process (internal)")
    parser.add_argument("--summary", help="where --mesh writes its summary (internal)")
    parser.add_argument("--real", action="store_true", help="with --mesh: the cases over the real TT-Transformers")
    parser.add_argument("--trees", choices=["both", "double", "real"], default="both",
                        help="run the cases over the double, over tt-metal's real TT-Transformers (real_tree.py), or "
                             "both (default)")
    parser.add_argument("--json", help="also write the summary here")
    args = parser.parse_args(argv)
    if args.mesh:
        return worker(args.mesh, Path(args.summary), args.real)
    from tests.tt_mock import real_tree

    runs = [(mesh_name, None) for mesh_name in MESHES] if args.trees != "real" else []
    if args.trees != "double":
        tree, where = real_tree.source()
        missing = real_tree.missing_modules() if tree else []
        if tree is None or missing:
            why = where if tree is None else f"this venv lacks {', '.join(missing)} (tests/tt_mock/setup.sh adds them)"
            print(f"  REAL TT-Transformers: skipped: {why}")
        else:
            print(f"  REAL TT-Transformers from {where}")
            runs += [(mesh_name, tree) for mesh_name in real_tree.meshes()]
    summaries, failures, calls, theirs = [], 0, Counter(), Counter()
    with tempfile.TemporaryDirectory() as jit:
        for mesh_name, tree in runs:
            env = {**os.environ, **mesh_env(mesh_name, jit, tree)}
            out = Path(jit) / f"{mesh_name}{'-real' if tree else ''}.json"
            worker_args = ["--mesh", mesh_name, "--summary", str(out)] + (["--real"] if tree else [])
            done = subprocess.run([sys.executable, "-m", "tests.tt_mock.run", *worker_args],
                                  cwd=jit, env=env, capture_output=True, text=True)  # tt-metal writes generated/ here
            try:
                summary = json.loads(out.read_text())
            except (OSError, json.JSONDecodeError):
                print(f"{mesh_name}: the worker died (exit {done.returncode}):\n{done.stdout[-4000:]}\n"
                      f"{done.stderr[-4000:]}")
                failures += 1
                continue
            summaries.append(summary)
            calls.update(summary["ours"])
            for r in summary["results"]:
                status = "ok" if r["error"] is None else "FAILED"
                theirs["TT-Transformers" if tree else "the double"] += r["their_calls"]
                print(f"  {r['case']}: {r['calls']} calls (+{r['their_calls']} by "
                      f"{'TT-Transformers' if tree else 'the double'}), {r['seconds']} s, {status}")
                for note in r["notes"]:
                    print(f"    {note}")
                if r["error"]:
                    failures += 1
                    print("    " + r["error"].replace("\n", "\n    "))
    print("  ttnn functions called by the project: " + ", ".join(f"{n.removeprefix('ttnn.')} x{c}"
                                                                  for n, c in sorted(calls.items())))
    if args.json:
        Path(args.json).write_text(json.dumps(summaries, indent=1))
    print(f"tt-mock: {sum(calls.values())} calls through ttnn 0.81.1 on mock N150, N300 1x2, T3K 1x8 and "
          f"Galaxy 8x4 ({', '.join(f'{n} by {who}' for who, n in theirs.items())}), {failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
