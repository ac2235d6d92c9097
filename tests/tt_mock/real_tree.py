# SPDX-License-Identifier: Apache-2.0
"""`make tt-mock`'s cases over tt-metal's REAL TT-Transformers (its `models/tt_transformers/{tt,model_params}` and
`models/common`) instead of the test double: a TT user's checkout at $TT_METAL_HOME when it is set, else the
reference tree beside this checkout (../shared/reference/tt-metal-622c6fb9, tt-metal main at 622c6fb9, about
v0.74-dev); skipped with the reason where neither is there. The package's path comes first (its models/__init__
extends the namespace over tt-metal's folders, README "Next to tt-metal").

Llama-3.1-8B's shapes with TT's dummy weights (ModelArgs(dummy_weights=True): its bundled model_params config and a
random HF model, no checkpoint; one layer, as TT's own unit tests build it) and the embedded SmolLM2-135M-Instruct with
its real weights (the converted folder the package caches; skipped with the reason where no run has converted it yet),
through the backend as the demo builds it: build_tt_model, TT's own prefill warm-up and the backend's, every planned
decode program once (each write-pass count, top k), a short prompt, one over 128 tokens (TT pads it to 1,024), a prompt
TT prefills in chunks where the mesh's chunk size allows, a verify step of several users with logits and top k, and a
plain step. On the cases marked so (N150's), also the taps on TT's real residual stream (each layer the model runs, at
most three) and a random EAGLE-3 head on the device reading them (run.exercise: its feed, chains and feed-only replay,
the prompts' taps, the tap tile gathered on the device and through the host), then the serving class's verify on a
KV cache allocated as TT's vLLM adapter allocates vLLM's (run.paged_verify), over the same model. Eager: the mock
device cannot capture traces."""
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
REFERENCE = REPO.parent / "shared" / "reference" / "tt-metal-622c6fb9"
# (mesh, model, max_seq_len, users, the device head and taps and the serving verify's K, or None): N150's chunk size
# (4,096 for Llama-3.1-8B, tt/model_config.py get_max_prefill_chunk_size) lets an 8,192 max_seq_len prefill in chunks;
# N300's and T3K's (64k) do not; on the Galaxy the model runs as TT runs it there, on one of its 1 x 8 submeshes
# (device.model_mesh, as make tt-smoke and the demo). The
# head, taps and serving verify run on N150 (the double runs them on every mesh; here they would add minutes a mesh)
CASES = [("N150", "Llama-3.1-8B-Instruct", 8192, 4, 7), ("N150", "SmolLM2-135M-Instruct", 1024, 4, 3),
         ("N300", "Llama-3.1-8B-Instruct", 1024, 4, None), ("T3K", "Llama-3.1-8B-Instruct", 1024, 4, None),
         ("Galaxy", "Llama-3.1-8B-Instruct", 1024, 4, None)]
# the random head's draft vocabulary (run.SHAPES'); the target's where not named
HEAD_DRAFT_VOCAB = {"Llama-3.1-8B-Instruct": 32000}
N_LAYERS = 1  # dummy 8B layers cost ~1 GB of host memory each (an fp32 HF model)
EMBEDDED = "SmolLM2-135M-Instruct.Q4_1"  # checkpoints/checkpoint.py EMBEDDED_GGUF's stem


def source() -> tuple[Optional[Path], str]:
    """The TT-Transformers tree to run, or None and why not."""
    home = os.environ.get("TT_METAL_HOME")
    for root, what in ((Path(home), "$TT_METAL_HOME") if home else (None, None), (REFERENCE, "the reference tree")):
        if root is not None and (root / "models" / "tt_transformers" / "tt" / "model.py").is_file():
            return root, f"{what} {root}"
    return None, (f"no tt-metal tree: TT_METAL_HOME={home!r} has no models/tt_transformers/tt/model.py and "
                  f"{REFERENCE} is not there")


def missing_modules() -> list[str]:
    """TT-Transformers' Python dependencies beyond ttnn's that this venv lacks (tests/tt_mock/setup.sh installs
    them)."""
    import importlib.util

    return [m for m in ("pydantic", "tqdm", "pytest", "transformers") if importlib.util.find_spec(m) is None]


def embedded_folder() -> Optional[Path]:
    """The embedded model's converted HF folder (checkpoints/checkpoint.py _gguf_checkpoint), if a run made it."""
    from models.tt_transformers.checkpoints.cache import cache_root

    folder = cache_root() / EMBEDDED / "hf"
    return folder if (folder / "config.json").is_file() else None


@contextmanager
def dummy_weights():
    """ModelArgs(..., dummy_weights=True) while the backend builds: TT's own way to build a model without its
    checkpoint (tt/model_config.py ModelArgs.__init__ and load_state_dict: the bundled LOCAL_HF_PARAMS config, a
    random HF model of n_layers layers). Test harness only: the backend builds from real checkpoints."""
    from models.tt_transformers.tt import model_config

    init = model_config.ModelArgs.__init__

    def forced(self, *args, **kwargs):
        kwargs["dummy_weights"] = True
        init(self, *args, **kwargs)
    model_config.ModelArgs.__init__ = forced
    try:
        yield
    finally:
        model_config.ModelArgs.__init__ = init


def run_case(mesh, name: str, max_seq_len: int, users: int, folder: Path, k: Optional[int], work: Path
             ) -> list[str]:
    """One model through the backend over the real tree; with k, the device head and taps first and the serving
    verify for K = k after; returns notes (TT's settings as it built them)."""
    import torch

    from models.tt_transformers.checkpoints.eagle3_format import random_head
    from models.tt_transformers.speculative.backend import UserRows
    from models.tt_transformers.ttnn_backend.causal_lm import TtnnCausalLM
    from models.tt_transformers.ttnn_backend.eagle3_head import TtnnDraftHead
    from models.tt_transformers.ttnn_backend.device import model_mesh
    from models.tt_transformers.ttnn_backend.model import build_tt_model
    from models.tt_transformers.ttnn_backend.traces import MeshTraces
    from tests.tt_mock.run import N_DRAFT, exercise, paged_verify

    mesh = model_mesh(mesh)  # as the smoke and the demo run it: on a Galaxy TT's first 1 x 8 submesh
    if folder.name == "hf":  # real weights
        tt = build_tt_model(mesh, folder, name, users, max_seq_len, True, n_layers=2)
    else:
        with dummy_weights():
            tt = build_tt_model(mesh, folder, name, users, max_seq_len, True, n_layers=N_LAYERS)
    # the grouped verify attention (--grouped_verify 1) through TT's real attention; the double's cases run per row
    lm = TtnnCausalLM(tt, users, max_seq_len, mesh_traces=MeshTraces(mesh), trace=False, grouped_attention=True)
    args, shape = tt.args, tt.config
    taps = tuple(range(min(3, tt.n_layers))) if k else ()  # EAGLE-3 reads three layers; these models run one or two
    try:
        lm.warm_up(N_DRAFT + 1, 4, taps)  # TT's warm-up (no on-device sampling), the backend's; top k, the taps
        if k:
            head_config, weights = random_head(shape, draft_vocab=HEAD_DRAFT_VOCAB.get(name), taps=taps)
            embedding = torch.zeros(shape.vocab_size, shape.dim, dtype=torch.bfloat16)
            head = TtnnDraftHead(lm, head_config, weights, embedding, N_DRAFT, shape, cache_dir=work / "head" / name)
            try:
                exercise(lm, head, taps, shape.dim)  # every program once, a chunked prompt's taps, drafts, a verify
            finally:
                head.release()
        else:
            lm.prepare_traces()  # every planned decode program once (each write-pass count, with and without top k)
        prompts = [list(range(1, 41)), [i % 1000 + 1 for i in range(200)]]  # padded to 128 and to 1,024
        if not k and args.max_prefill_chunk_size < max_seq_len - 8:  # (exercise prefilled one)
            prompts.append([i % 1000 + 1 for i in range(args.max_prefill_chunk_size + 100)])  # chunked
        for user, prompt in enumerate(prompts):
            lm.prefill(user % users, prompt, taps=taps)
        rows = [UserRows(u, [7, 8, 9, 10, 11][: 5 - u], len(prompts[u])) for u in range(min(users, len(prompts)))]
        step = lm.step(rows, logits=True, top_k=4, taps=taps)
        assert [len(ids) for ids in step.ids] == [len(r.tokens) for r in rows]
        lm.step([UserRows(0, [3], len(prompts[0]) + 5)])  # a plain decode step
        assert len(lm.tt_greedy(0, prompts[0], 3)) == 3  # TT's own untraced decode: make tt-smoke's reference
    finally:
        lm.release()
    if k:
        paged_verify(tt, min(max_seq_len, 1024), k, work)  # run.SERVING's max_model_len
    return [f"{args.model_name} on {args.device_name} {tuple(mesh.shape)}: {tt.n_layers} layer(s), "
            f"max_prefill_chunk_size {args.max_prefill_chunk_size}, ccl_topology {args.ccl_topology()}, prompts of "
            f"{[len(p) for p in prompts]}" + (f", taps {list(taps)}, serving verify K={k}" if k else "")]


def cases(mesh_name: str, mesh, work: Path, embedded: Optional[Path]) -> list[tuple]:
    """(name, call) of the real tree's cases on this mesh; a case that cannot run here is a call that says why.
    embedded: embedded_folder(), looked up before the worker moves TT_CACHE_PATH."""
    from functools import partial

    from tests.tt_mock.run import LLAMA_8B, checkpoint

    out = []
    for case_mesh, name, max_seq_len, users, k in CASES:
        if case_mesh != mesh_name:
            continue
        label = f"{mesh_name} REAL TT-Transformers {name} max_seq_len {max_seq_len} batch {users}" + (
            f", device head and taps, serving verify on vLLM's cache K={k}" if k else "")
        if name.startswith("SmolLM2"):
            if embedded is None:
                out.append((label + " (real weights)", partial(skip, "the embedded model is not converted yet "
                                                                    "(make demo or make test converts it)")))
                continue
            out.append((label + " (real weights, 2 layers)", partial(run_case, mesh, name, max_seq_len, users,
                                                                      embedded, k, work)))
        else:
            out.append((label + f" (dummy weights, {N_LAYERS} layer)",
                        partial(run_case, mesh, name, max_seq_len, users, checkpoint(work, name, LLAMA_8B), k, work)))
    return out


def skip(reason: str) -> list[str]:
    return [f"skipped: {reason}"]


def meshes() -> list[str]:
    return list(dict.fromkeys(case[0] for case in CASES))
