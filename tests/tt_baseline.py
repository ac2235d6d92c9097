# SPDX-License-Identifier: Apache-2.0
"""The baseline a TT user runs without this package: TT-Transformers' own decode, as tt-metal's text demo runs it
(models/tt_transformers/demo/simple_text_demo.py, read in its 2026 form): the model from create_tt_model with TT's
defaults (its own attention, its default use_qk_fused), Generator.prefill_forward_text, then
Generator.decode_forward traced, with on-device sampling where the model supports it (`_supports_on_device_sampling`;
greedy as the demo passes it: SamplingParams(temperature=0, top_p=0.08, top_k=32), which TT turns into an argmax) and
host sampling otherwise. Decode tokens/s/user is the demo's: the steps after the first (which compiles and captures),
(n - 1) / their time.

The model is dropped after the run with every trace it made released: TT's Generator's own (its trace_id* attributes:
the decode traces, and the prefill traces of versions that trace prefill) and, with on-device sampling, the sampling
module's (TT's split sampling captures a second trace inside models/common/sampling/generator.py
SamplingGenerator.capture_trace, released only by its reset_trace). TT-Transformers' Generator.__del__ differs by
version: at 000ec121 and d9d95fa3 it only closes the data-parallel submeshes (`# Workaround for issue #19052`); the
2026 split-sampling form the backend follows (read for 87700c07) releases its prefill, prefill-sampling and decode
traces (trace_id_prefill, trace_id_prefill_sampling, trace_ids_decode) but not the sampling module's. So that such a
destructor could not release a trace twice, the Generator's trace_id* attributes are emptied once their traces are
released here. Then the mesh's trace region and DRAM must be back where they were before the baseline was built
(ttnn.get_memory_view), or the run stops with what is left: the perf test builds ours next, its trace region sized for
ours alone.

Our plain decoding runs our verify-shaped step (ordered cache writes, the whole logits tile): the perf test times
both on the same checkpoint, so speedups are stated against what a TT user would pick as well as against our own
plain decoding, and compare with TT's published targets.
"""
import gc
import time
from pathlib import Path
from typing import Sequence

import torch

from models.tt_transformers.ttnn_backend.traces import release_all
from models.tt_transformers.ttnn_backend.model import model_args_seq_len, model_env, paged_cache, precision, supported_kwargs
from models.tt_transformers.ttnn_backend.tt_surface import decode_logits

TT_DEMO_BATCHES = (1, 2, 4, 8, 16, 32)  # ModelArgs' supported_batches
GREEDY = {"temperature": 0, "top_p": 0.08, "top_k": 32}  # simple_text_demo.py's greedy sampling parameters


def tt_decode_baseline(mesh_device, folder: Path, name: str, prompts: Sequence[Sequence[int]], n_tokens: int,
                       max_seq_len: int, instruct: bool, weights_dtype=None, optimizations: str = "performance"
                       ) -> dict:
    """Greedy decoding of `prompts` (one batch) for n_tokens with TT-Transformers' own Generator; the model is built
    for this call and dropped after it, its traces released (module docstring), so build it before the models it is
    compared with, or after they are released: two 8B models do not fit an N150's DRAM together."""
    import ttnn
    from models.tt_transformers.tt.common import create_tt_model
    from models.tt_transformers.tt.generator import Generator, SamplingParams

    batch = next(b for b in TT_DEMO_BATCHES if b >= len(prompts))
    paged, page_table = paged_cache(batch, max_seq_len)  # block 0 a sink, as our models' (model.py)
    before = device_usage(mesh_device)
    with model_env(Path(folder), name):
        args, model, kv_cache, _ = create_tt_model(mesh_device, **supported_kwargs(
            create_tt_model, instruct=instruct, max_batch_size=batch, optimizations=precision(optimizations),
            max_seq_len=model_args_seq_len(max_seq_len), paged_attention_config=paged,
            dtype=weights_dtype or ttnn.bfloat8_b))
    generator = Generator([model], [args], mesh_device)
    try:
        rows = [list(p) for p in prompts] + [list(prompts[0])] * (batch - len(prompts))  # idle users: a copy
        lens = [len(r) for r in rows]
        padded = torch.tensor([r + [0] * (max(lens) - len(r)) for r in rows])
        sampling = SamplingParams(**GREEDY) if getattr(model, "_supports_on_device_sampling", False) else None
        out = generator.prefill_forward_text(padded, **supported_kwargs(
            generator.prefill_forward_text, page_table=page_table, kv_cache=[kv_cache], prompt_lens=lens,
            sampling_params=sampling, enable_trace=False))
        token = next_tokens(out, sampling is not None)
        current_pos, outputs, seconds = torch.tensor(lens), [token], []
        for i in range(n_tokens - 1):
            start = time.perf_counter()
            out = generator.decode_forward(token.view(batch, 1), current_pos, **supported_kwargs(
                generator.decode_forward, enable_trace=True, page_table=page_table, kv_cache=[kv_cache],
                reset_batch=i == 0, sampling_params=sampling, output_tokens=token.view(batch, 1)))
            token = next_tokens(out, sampling is not None)
            seconds.append(time.perf_counter() - start)
            outputs.append(token)
            current_pos += 1
    finally:
        release_all(mesh_device, generator_traces(generator))
        forget_traces(generator)
        for sampling_module in (getattr(m, "sampling", None) for m in generator.model):  # split sampling's traces
            if hasattr(sampling_module, "reset_trace"):
                sampling_module.reset_trace()
        del generator, model, kv_cache, sampling_module
        gc.collect()
    check_released(before, device_usage(mesh_device))
    timed = seconds[1:]  # the first step compiles and captures (TT's compile_decode)
    per_user = len(timed) / sum(timed) if timed else 0.0
    return {"decode_t/s/u": per_user, "decode_t/s": per_user * len(prompts), "on_device_sampling": sampling is not None,
            "batch": batch, "tokens": torch.stack(outputs, dim=1)[: len(prompts)].tolist()}


# DRAM a dropped baseline may keep: its programs' kernel binaries stay in the program cache (a few MB); its weights and
# KV cache (GBs for an 8B) must not
DRAM_LEFT_BYTES = 256 * 2**20


def device_usage(mesh_device) -> dict[str, int]:
    """Bytes allocated on the mesh's first device, in DRAM and in the trace region (ttnn.get_memory_view, summed over
    the banks)."""
    import ttnn

    def allocated(buffer_type) -> int:
        view = ttnn.get_memory_view(mesh_device, buffer_type)
        return view.total_bytes_allocated_per_bank * view.num_banks
    return {"DRAM": allocated(ttnn.BufferType.DRAM), "trace region": allocated(ttnn.BufferType.TRACE)}


def check_released(before: dict[str, int], after: dict[str, int]) -> None:
    """One error naming what the dropped baseline left: any trace-region bytes (a trace not released), or DRAM beyond
    DRAM_LEFT_BYTES (the model itself kept alive)."""
    left = {kind: after[kind] - before[kind] for kind in before}
    if left["trace region"] > 0 or left["DRAM"] > DRAM_LEFT_BYTES:
        raise RuntimeError(f"TT's decode baseline left {left['trace region'] / 1e6:.1f} MB of trace region and "
                           f"{left['DRAM'] / 1e6:.0f} MB of DRAM allocated after it was dropped: a trace or the model "
                           "was not released, and the models built next would not fit the region sized for them "
                           "(tt_baseline.py releases TT's decode and sampling traces: a TT-Transformers version that "
                           "keeps others needs them added there)")


def generator_traces(generator) -> list:
    """The trace ids TT's Generator holds (its trace_id* attributes: dicts keyed by sampling mode and model, or ids),
    released here rather than left to a destructor the 2026 generator.py may not have."""
    def ids(value):
        if isinstance(value, dict):
            return [i for v in value.values() for i in ids(v)]
        if isinstance(value, (list, tuple)):
            return [i for v in value for i in ids(v)]
        return [] if value is None else [value]
    return [i for name, value in vars(generator).items() if name.startswith("trace_id") for i in ids(value)]


def forget_traces(generator) -> None:
    """The Generator's trace_id* attributes emptied (a dict cleared, an id set to None) once generator_traces' ids
    are released: a destructor that releases what they hold (module docstring) finds nothing left."""
    for name, value in list(vars(generator).items()):
        if name.startswith("trace_id"):
            if isinstance(value, dict):
                value.clear()
            else:
                setattr(generator, name, None)


def next_tokens(out, sampled_on_device: bool) -> torch.Tensor:
    """Each user's next token from what prefill_forward_text / decode_forward return: token ids where TT sampled on
    the device (`(tokens, log_probs)`), else the host argmax of the logits [B, 1, V] (or [B, V])."""
    first = decode_logits(out)
    first = torch.as_tensor(first)
    if sampled_on_device:
        return first.reshape(-1).long()
    return first.reshape(first.shape[0], -1).float().argmax(dim=-1)
