# SPDX-License-Identifier: Apache-2.0
"""TEST DOUBLE standing in for the TT-Transformers surface the ttnn backend drives (models.tt_transformers.tt at
tt-metal v0.81.1: ModelArgs, Transformer, Attention, PagedAttentionConfig, copy_host_to_device, Generator). It is
not TT-Transformers: it computes the checkpoint's model in float32 torch through the stand-in ttnn ops
(stand-in ttnn.py), keeping the interfaces and the constraints the real code has (names, keyword arguments,
HF_MODEL, max_batch_size in {1, 2, 4, 8, 16, 32}, tokens padded to a 32-row tile, per-row RoPE positions clamped at
0, the attention_class hook, the cache update through ttnn.experimental.paged_update_cache with
update_idxs_tensor=current_pos, paged SDPA decode bounded by each row's position, 128-padded prefill into a user's
page-table row, an LM head padded past the vocabulary)."""
import json
import math
import os
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F

from models.tt_transformers.torch_backend.checkpoint import load_model, resolve_checkpoint
from models.tt_transformers.torch_backend.model_config import ModelArgs as TorchModelArgs
from models.tt_transformers.torch_backend.rope import apply_rope

from . import ttnn

PADDED_VOCAB_GARBAGE = 1e4  # the padded LM-head columns are not vocabulary: the backend must never pick them


COMPUTE_DTYPES = {ttnn.float32: torch.float32, ttnn.bfloat16: torch.bfloat16, ttnn.bfloat8_b: torch.bfloat16}


@lru_cache(maxsize=2)
def torch_model(folder: str, dtype: torch.dtype):
    """The checkpoint as our torch model (torch ops): where the stand-in takes its weights from. Rotary tables
    reach 2,048 positions: a 128-padded prefill may run past a short max_seq_len."""
    return load_model(resolve_checkpoint(folder), dtype, 2048, cpu_kernels=False)


class PagedAttentionConfig:
    def __init__(self, block_size=32, max_num_blocks=1024):
        self.block_size = block_size
        self.max_num_blocks = max_num_blocks


def copy_host_to_device(host_tensors, device_tensors=None, mesh_device=None):
    if device_tensors is None:
        return [ttnn.to_device(t, device=mesh_device) if t else None for t in host_tensors]
    for host, device in zip(host_tensors, device_tensors):
        if host is not None:
            ttnn.copy_host_to_device_tensor(host, device)
    return device_tensors


def get_padded_prefill_len(seq_len: int) -> int:
    """As TT-Transformers: 128 for short prompts, else the next power of two (then multiples of 2048)."""
    if seq_len <= 128:
        return 128
    return 2 ** math.ceil(math.log2(seq_len)) if seq_len <= 2048 else 2048 * math.ceil(seq_len / 2048)


class ModelArgs:
    def __init__(self, mesh_device, instruct=False, dummy_weights=False, max_batch_size=1, max_seq_len=1024 * 128,
                 optimizations=None, cache_hf=False):
        hf_model = os.getenv("HF_MODEL")
        assert hf_model, "Please set HF_MODEL to a HuggingFace name e.g. meta-llama/Llama-3.1-8B-Instruct"
        if max_batch_size not in {1, 2, 4, 8, 16, 32}:
            raise ValueError(f"Batch size {max_batch_size} not supported")
        self.CKPT_DIR, self.mesh_device, self.instruct = hf_model, mesh_device, instruct
        self.max_batch_size, self.max_seq_len, self.tile_size = max_batch_size, max_seq_len, 32
        config = TorchModelArgs.from_hf_config(json.loads((Path(hf_model) / "config.json").read_text()))
        self.torch_args = config
        self.n_layers, self.vocab_size, self.dim = config.n_layers, config.vocab_size, config.dim
        self.padded_vocab_size = (config.vocab_size // 128 + 2) * 128
        self.is_galaxy, self.cluster_shape, self.use_qk_fused = False, list(mesh_device.shape), True
        cache = os.getenv("TT_CACHE_PATH")
        self.model_cache_path = Path(cache) / "N150" if cache else Path("model_cache") / hf_model / "N150"

    def weight_cache_path(self, dtype):
        return self.model_cache_path / ("tensor_cache_instruct_bfp8" if self.instruct else "tensor_cache_bfp8")

    def load_state_dict(self):
        return {"folder": self.CKPT_DIR}  # the stand-in's "state dict": where the weights are


class Attention:
    def __init__(self, mesh_device, tt_ccl, args, state_dict, weight_cache_path, layer_num, dtype,
                 transformation_mats, configuration, paged_attention_config=None, use_paged_kv_cache=False,
                 prefetcher=None):
        a = args.torch_args
        self.args, self.model, self.block = args, state_dict, state_dict.layers[layer_num]
        self.n_heads, self.n_kv_heads, self.head_dim = a.n_heads, a.n_kv_heads, a.head_dim
        self.scale, self.sliding_window = a.head_dim ** -0.5, a.sliding_window
        shape = (paged_attention_config.max_num_blocks, a.n_kv_heads, paged_attention_config.block_size, a.head_dim)
        self.layer_past = [ttnn.Tensor(torch.zeros(shape, dtype=state_dict.dtype), ttnn.bfloat8_b, ttnn.TILE_LAYOUT,
                                       mesh_device) for _ in range(2)]

    def _qkv_rope(self, x, rope_idxs):
        H, Hk, D = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.block.attention.wqkv(x.data.view(1, 32, -1)).view(1, 32, H + 2 * Hk, D)
        pos = rope_idxs.data.view(-1)
        cos = self.model.rope_cos[pos].view(1, 32, 1, D)
        sin = self.model.rope_sin[pos].view(1, 32, 1, D)
        qk = apply_rope(qkv[:, :, : H + Hk], cos, sin)
        return ((qk[:, :, :H].contiguous(), ttnn.bfloat16, ttnn.TILE_LAYOUT),
                (qk[:, :, H:].contiguous(), ttnn.bfloat16, ttnn.TILE_LAYOUT),
                (qkv[:, :, H + Hk :].contiguous(), ttnn.bfloat16, ttnn.TILE_LAYOUT))

    def forward_decode(self, x, current_pos, rot_mats=None, page_table=None, kv_cache=None):
        q, k, v = ttnn.run_op("qkv_rope", self._qkv_rope, x, rot_mats)
        keys, values = kv_cache if kv_cache else self.layer_past
        if self.args.use_qk_fused:
            ttnn.experimental.paged_fused_update_cache(keys, k, values, v, update_idxs_tensor=current_pos,
                                                       page_table=page_table)
        else:
            ttnn.experimental.paged_update_cache(keys, k, update_idxs_tensor=current_pos, page_table=page_table)
            ttnn.experimental.paged_update_cache(values, v, update_idxs_tensor=current_pos, page_table=page_table)
        out = ttnn.transformer.paged_scaled_dot_product_attention_decode(
            q, keys, values, page_table_tensor=page_table, cur_pos_tensor=current_pos, scale=self.scale,
            sliding_window_size=self.sliding_window, memory_config=ttnn.DRAM_MEMORY_CONFIG)
        return ttnn.run_op("wo", lambda a: (self.block.attention.wo(a.data.reshape(1, 1, 32, -1)), ttnn.bfloat16,
                                            ttnn.TILE_LAYOUT), out)


class TransformerBlock:
    def __init__(self, block, attention):
        self.block, self.attention = block, attention

    def forward_decode(self, x, current_pos, rot_mats, page_table, kv_cache):
        normed = ttnn.run_op("attention_norm", lambda t: (self.block.attention_norm(t.data), t.dtype, t.layout), x)
        attn = self.attention.forward_decode(normed, current_pos, rot_mats=rot_mats, page_table=page_table,
                                             kv_cache=kv_cache)

        def residual_mlp(h, a):
            h = h.data + a.data
            return h + self.block.feed_forward(self.block.ffn_norm(h)), ttnn.bfloat16, ttnn.TILE_LAYOUT
        return ttnn.run_op("residual_mlp", residual_mlp, x, attn)


class DistributedNorm:
    """The final norm, called as TT-Transformers' forward calls it: norm(x, mode=..., norm_config=...)."""

    def __init__(self, norm):
        self.norm = norm

    def __call__(self, x, mode="decode", norm_config=None):
        return ttnn.run_op("norm", lambda t: (self.norm(t.data), ttnn.bfloat16, ttnn.TILE_LAYOUT), x)


class Transformer:
    def __init__(self, args, dtype, mesh_device, state_dict, weight_cache_path, paged_attention_config=None,
                 use_paged_kv_cache=False, attention_class=None, rope_setup_class=None, prefetcher=None):
        state_dict = torch_model(state_dict["folder"], COMPUTE_DTYPES[dtype])  # computes in the weights' dtype
        self.args, self.mesh_device, self.model = args, mesh_device, state_dict
        self.vocab_size, self.n_layers = args.vocab_size, args.n_layers
        self.norm = DistributedNorm(state_dict.norm)
        attention_class = attention_class or Attention
        self.layers = [TransformerBlock(state_dict.layers[i], attention_class(
            mesh_device=mesh_device, tt_ccl=None, args=args, state_dict=state_dict, weight_cache_path=weight_cache_path,
            layer_num=i, dtype=dtype, transformation_mats={}, configuration=args,
            paged_attention_config=paged_attention_config, use_paged_kv_cache=use_paged_kv_cache, prefetcher=prefetcher))
            for i in range(args.n_layers)]

    def prepare_decode_inputs_host(self, tokens, current_pos, page_table=None):
        B = tokens.shape[0]
        assert current_pos.shape[0] == B, "Batch size mismatch"
        assert B == self.args.max_batch_size, f"Batch size {B} must be equal to max_batch_size {self.args.max_batch_size}"
        tokens = F.pad(tokens.view(-1), (0, 32 - len(tokens)), "constant", 0)
        tokens = ttnn.unsqueeze_to_4D(ttnn.from_torch(tokens, device=None, dtype=ttnn.uint32,
                                                      mesh_mapper=ttnn.ReplicateTensorToMesh(self.mesh_device)))
        rope_idxs = ttnn.from_torch(torch.clamp(current_pos, min=0), dtype=ttnn.int32)
        mapper = ttnn.ShardTensor2dMesh(self.mesh_device, dims=(None, None), mesh_shape=self.args.cluster_shape)
        current_pos_tt = ttnn.from_torch(current_pos, device=None, dtype=ttnn.int32, mesh_mapper=mapper)
        if page_table is not None:
            page_table = ttnn.from_torch(page_table, device=None, dtype=ttnn.int32, mesh_mapper=mapper)
        return tokens, current_pos_tt, rope_idxs, page_table

    def ttnn_decode_forward(self, x, current_pos, rot_mat_idxs=None, page_table=None, kv_cache=None,
                            sampling_on_device=False, capture_sampling_trace=False):
        m = self.model
        h = ttnn.run_op("embedding", lambda t: (m.tok_embeddings(t.data.view(-1)[:32]).view(1, 1, 32, -1),
                                                ttnn.bfloat16, ttnn.TILE_LAYOUT), x)
        for layer, kv in zip(self.layers, kv_cache):
            h = layer.forward_decode(h, current_pos, rot_mat_idxs, page_table, kv)

        def lm_head(t):  # untilized, as TT-Transformers returns it; columns past the vocabulary are padding
            logits = m.output(t.data).float()
            padded = torch.full((*logits.shape[:-1], self.args.padded_vocab_size), PADDED_VOCAB_GARBAGE)
            padded[..., : self.vocab_size] = logits
            return padded, ttnn.bfloat16, ttnn.ROW_MAJOR_LAYOUT
        return ttnn.run_op("lm_head", lm_head, self.norm(h, mode="decode")), None

    def prefill(self, ids: torch.Tensor, seq_len: int, page_row: torch.Tensor, kv_cache) -> torch.Tensor:
        """The padded prompt through every layer (causal), K/V of its real positions into the user's pages; the
        last real token's logits [vocab]."""
        m, a = self.model, self.args.torch_args
        S, H, Hk, D = ids.shape[-1], a.n_heads, a.n_kv_heads, a.head_dim
        x = m.tok_embeddings(ids.view(1, S))
        cos, sin = m.rope_cos[:S].view(1, S, 1, D), m.rope_sin[:S].view(1, S, 1, D)
        pos = torch.arange(S)
        visible = pos.view(-1, 1) >= pos.view(1, -1)
        if a.sliding_window is not None:
            visible &= pos.view(-1, 1) - pos.view(1, -1) < a.sliding_window
        real = torch.arange(seq_len)
        for layer, (keys, values) in zip(self.layers, kv_cache):
            b = layer.block
            qkv = b.attention.wqkv(b.attention_norm(x)).view(1, S, H + 2 * Hk, D)
            qk = apply_rope(qkv[:, :, : H + Hk], cos, sin)
            q, k, v = qk[:, :, :H], qk[:, :, H:], qkv[:, :, H + Hk :]
            blocks = page_row.long()[real // 32]
            keys.data[blocks, :, real % 32] = k[0, :seq_len]
            values.data[blocks, :, real % 32] = v[0, :seq_len]
            attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(H // Hk, 1),
                                                  v.transpose(1, 2).repeat_interleave(H // Hk, 1), attn_mask=visible)
            x = x + b.attention.wo(attn.transpose(1, 2).reshape(1, S, H * D))
            x = x + b.feed_forward(b.ffn_norm(x))
        return m.output(m.norm(x[0, seq_len - 1])).float()


class Generator:
    def __init__(self, model, model_args, mesh_device, processor=None, tokenizer=None):
        self.model, self.model_args, self.mesh_device = model, model_args, mesh_device

    def prefill_forward_text(self, tokens, page_table=None, kv_cache=None, prompt_lens=None, empty_slots=None,
                             enable_trace=True, model_id_warmup=None, sampling_params=None, start_pos=None,
                             return_hidden_states=False, warmup_prefill=True, **kwargs):
        batch_size = tokens.shape[0]
        out = torch.zeros(batch_size, 1, self.model_args[0].vocab_size)
        for idx, user_id in enumerate(empty_slots if empty_slots is not None else range(batch_size)):
            model_id = user_id // self.model_args[0].max_batch_size
            seq_len = int(prompt_lens[idx])
            ids = F.pad(tokens[idx, :seq_len], (0, get_padded_prefill_len(seq_len) - seq_len))
            with torch.no_grad():
                out[idx, 0] = self.model[model_id].prefill(ids, seq_len, page_table[idx], kv_cache[model_id])
        return out
