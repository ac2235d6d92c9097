# SPDX-License-Identifier: Apache-2.0
"""The baseline a TT user runs without this package: TT-Transformers' own decode, as tt-metal's text demo runs it
(models/tt_transformers/demo/simple_text_demo.py, read in its 2026 form): the model from create_tt_model with TT's
defaults (its own attention, its default use_qk_fused), Generator.prefill_forward_text, then
Generator.decode_forward traced, with on-device sampling where the model supports it (`_supports_on_device_sampling`;
greedy as the demo passes it: SamplingParams(temperature=0, top_p=0.08, top_k=32), which TT turns into an argmax) and
host sampling otherwise. Decode tokens/s/user is the demo's: the steps after the first (which compiles and captures),
(n - 1) / their time.

Our plain decoding runs our verify-shaped step (ordered cache writes, the whole logits tile): the perf test times
both on the same checkpoint, so speedups are stated against what a TT user would pick as well as against our own
plain decoding, and compare with TT's published targets.
"""
import gc
import time
from pathlib import Path
from typing import Sequence

import torch

from .generator import release_all
from .model import BLOCK_SIZE, blocks_per_user, model_args_seq_len, model_env, precision, supported_kwargs
from .tt_surface import decode_logits

TT_DEMO_BATCHES = (1, 2, 4, 8, 16, 32)  # ModelArgs' supported_batches
GREEDY = {"temperature": 0, "top_p": 0.08, "top_k": 32}  # simple_text_demo.py's greedy sampling parameters


def tt_decode_baseline(mesh_device, folder: Path, name: str, prompts: Sequence[Sequence[int]], n_tokens: int,
                       max_seq_len: int, instruct: bool, weights_dtype=None, optimizations: str = "performance"
                       ) -> dict:
    """Greedy decoding of `prompts` (one batch) for n_tokens with TT-Transformers' own Generator; the model is built
    for this call and dropped after it (its traces released by TT's Generator.__del__), so build it before the
    models it is compared with, or after they are released: two 8B models do not fit an N150's DRAM together."""
    import ttnn
    from models.tt_transformers.tt.common import PagedAttentionConfig, create_tt_model
    from models.tt_transformers.tt.generator import Generator, SamplingParams

    batch = next(b for b in TT_DEMO_BATCHES if b >= len(prompts))
    blocks = blocks_per_user(max_seq_len)
    paged = PagedAttentionConfig(block_size=BLOCK_SIZE, max_num_blocks=batch * blocks)
    with model_env(Path(folder), name):
        args, model, kv_cache, _ = create_tt_model(mesh_device, **supported_kwargs(
            create_tt_model, instruct=instruct, max_batch_size=batch, optimizations=precision(optimizations),
            max_seq_len=model_args_seq_len(max_seq_len), paged_attention_config=paged,
            dtype=weights_dtype or ttnn.bfloat8_b))
    generator = Generator([model], [args], mesh_device)
    try:
        page_table = torch.arange(batch * blocks, dtype=torch.int32).view(batch, blocks)
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
        del generator, model, kv_cache
        gc.collect()
    timed = seconds[1:]  # the first step compiles and captures (TT's compile_decode)
    per_user = len(timed) / sum(timed) if timed else 0.0
    return {"decode_t/s/u": per_user, "decode_t/s": per_user * len(prompts), "on_device_sampling": sampling is not None,
            "batch": batch, "tokens": torch.stack(outputs, dim=1)[: len(prompts)].tolist()}


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


def next_tokens(out, sampled_on_device: bool) -> torch.Tensor:
    """Each user's next token from what prefill_forward_text / decode_forward return: token ids where TT sampled on
    the device (`(tokens, log_probs)`), else the host argmax of the logits [B, 1, V] (or [B, V])."""
    first = decode_logits(out)
    first = torch.as_tensor(first)
    if sampled_on_device:
        return first.reshape(-1).long()
    return first.reshape(first.shape[0], -1).float().argmax(dim=-1)
