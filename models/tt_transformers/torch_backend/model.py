# SPDX-License-Identifier: Apache-2.0
"""Compact Llama/Mistral decoder (gpt-fast style) with a static KV cache that lives outside the weights.

Keeping the cache outside the modules lets a draft made of the first N layers share every weight
tensor with the target while owning a cache of its own.
"""
from typing import Optional

import torch
from torch import nn

from .attention import Attention, StepInputs
from .cpu_kernels import CpuKernels
from .mlp import MLP
from .model_config import ModelArgs
from .rope import rope_tables


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Written out as transformers does (float32 statistics): bit-identical in float32, and on CPU
        # faster than F.rms_norm for one-token steps.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def can_prepack(dtype: torch.dtype, device) -> bool:
    return (dtype == torch.bfloat16 and torch.device(device).type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class PackedLinear(nn.Module):
    """A bf16 CPU linear layer whose weight is reordered for oneDNN once, instead of on every call.

    F.linear reorders the weight each call, which halves the rate at which the per-layer weights stream from
    memory. Prepacked, the matmul runs at about twice the rate and costs nearly the same from 1 to 17 rows,
    which is what makes verifying drafts cheap; results equal F.linear's bit for bit and do not depend on how
    many rows share the call (tests/test_row_invariance.py).
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [None], "")


class KernelLinear(nn.Module):
    """A bf16 CPU linear layer on cpu_kernels.c: weights packed once, streamed at close to memory bandwidth, each
    output accumulated in an order that does not depend on the number of rows."""

    def __init__(self, linear: nn.Linear, kernels: CpuKernels, out_dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.kernels, self.out_dtype, self.out_features = kernels, out_dtype, linear.out_features
        self.packed = kernels.pack_weight(linear.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.linear(x, self.packed, self.out_features, self.out_dtype)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, dtype: torch.dtype):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps, dtype)
        self.attention = Attention(args, dtype)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps, dtype)
        self.feed_forward = MLP(args, dtype)
        self.kernels: Optional[CpuKernels] = None  # set by Transformer.use_cpu_kernels, with kernel_args
        self.kernel_args: tuple = ()

    def forward(self, x, step: StepInputs, k_cache, v_cache):
        if step.exact_table is not None:
            return self.kernels.decoder_layer(x, self.kernel_args, step.exact_table, step.cos, step.sin, k_cache,
                                              v_cache)
        h = x + self.attention(self.attention_norm(x), step, k_cache, v_cache)
        return h + self.feed_forward(self.ffn_norm(h))


class KVCache:
    """Per-layer K/V tensors [users, n_kv_heads, max_seq_len + 1, head_dim].

    The extra last slot is scratch: padding tokens of a ragged batch write there and nothing reads it.
    """

    def __init__(self, args: ModelArgs, n_layers: int, n_users: int, max_seq_len: int, dtype, device):
        shape = (n_users, args.n_kv_heads, max_seq_len + 1, args.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.n_layers, self.n_users, self.max_seq_len = n_layers, n_users, max_seq_len
        self.scratch_slot = max_seq_len


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs, dtype: torch.dtype = torch.bfloat16, max_seq_len: int = 2048):
        super().__init__()
        self.args, self.dtype = args, dtype
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim, dtype=dtype)
        self.layers = nn.ModuleList(TransformerBlock(args, dtype) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps, dtype)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False, dtype=dtype)
        if args.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.max_seq_len = max_seq_len
        self.kernels: Optional[CpuKernels] = None  # set by use_cpu_kernels
        self.init_rope(self.output.weight.device)

    def init_rope(self, device) -> None:
        """(Re)build the rotary tables on `device`; needed after building the modules on the meta device."""
        cos, sin = rope_tables(self.args, self.max_seq_len + 1, self.dtype)  # + the scratch slot
        self.register_buffer("rope_cos", cos.to(device), persistent=False)
        self.register_buffer("rope_sin", sin.to(device), persistent=False)

    def supports_cpu_kernels(self) -> bool:
        return (self.dtype == torch.bfloat16 and self.tok_embeddings.weight.device.type == "cpu"
                and self.args.dim % 2 == 0 and self.args.hidden_dim % 16 == 0 and self.args.head_dim % 32 == 0
                and self.args.head_dim <= 256)

    def use_cpu_kernels(self, kernels: CpuKernels) -> None:
        """Run every linear layer on the bf16 CPU kernels (the LM head too, with float32 logits), and every layer of
        a packed step (decode, verification) in one kernel call. The head gets a packed copy of its weight; the tied
        embedding keeps the original. Call it once the weights are final: the kernels hold their addresses."""
        self.kernels = kernels
        a = self.args
        for layer in self.layers:
            for parent, name in ((layer.attention, "wqkv"), (layer.attention, "wo"),
                                 (layer.feed_forward, "w_gate_up"), (layer.feed_forward, "w_down")):
                setattr(parent, name, KernelLinear(getattr(parent, name), kernels))
            weights = (layer.attention_norm.weight, layer.attention.wqkv.packed, layer.attention.wo.packed,
                       layer.ffn_norm.weight, layer.feed_forward.w_gate_up.packed, layer.feed_forward.w_down.packed)
            layer.kernels = kernels
            layer.kernel_args = (a.dim, a.hidden_dim, a.n_heads, a.n_kv_heads, a.head_dim, a.norm_eps,
                                 *(w.data_ptr() for w in weights))
        self.output = KernelLinear(self.output, kernels, torch.float32)

    def prepack_linears(self) -> None:
        """Swap every layer's linear for a PackedLinear (bf16 on CPU). The LM head stays as it is: F.linear already
        streams that one large matrix at full speed, and a tied head shares its tensor with the embedding."""
        for layer in self.layers:
            for parent, name in ((layer.attention, "wqkv"), (layer.attention, "wo"),
                                 (layer.feed_forward, "w_gate_up"), (layer.feed_forward, "w_down")):
                setattr(parent, name, PackedLinear(getattr(parent, name)))

    def new_cache(self, n_layers: int, n_users: int) -> KVCache:
        return KVCache(self.args, n_layers, n_users, self.max_seq_len, self.dtype, self.tok_embeddings.weight.device)

    def step_inputs(self, positions: torch.Tensor, query_pos: torch.Tensor, rows: torch.Tensor, kv_len: int,
                    all_rows: bool, exact_tokens: Optional[list[tuple[int, int, int, int]]]) -> StepInputs:
        """Per-step tensors shared by all layers.

        positions [B, T]: the cache slot each token writes; rows [B, 1] (or [B, T]): its cache row; query_pos
        [B, T]: the position it attends from (padding tokens write the scratch slot and attend like the last real
        token). all_rows: the batch is every cache row in order, so attention reads a view. exact_tokens: see
        StepInputs; when given, no mask is built and rows may differ per token (a packed step). The caller decides
        these from host-side ints, so nothing here syncs a device.
        """
        if exact_tokens is not None and self.kernels is not None:  # the kernel gathers the rotary tables itself
            table = [(row, end - 1, first) for _, row, first, end in exact_tokens]
            return StepInputs(self.rope_cos, self.rope_sin, rows, positions, None, kv_len, None, exact_tokens,
                              torch.tensor(table, dtype=torch.int64))
        cos = self.rope_cos[positions].unsqueeze(2)
        sin = self.rope_sin[positions].unsqueeze(2)
        mask, read_rows = None, None
        if exact_tokens is None:
            key_pos = torch.arange(kv_len, device=positions.device)
            visible = key_pos <= query_pos.unsqueeze(-1)  # [B, T, kv_len]
            if self.args.sliding_window is not None:
                visible &= key_pos > query_pos.unsqueeze(-1) - self.args.sliding_window
            groups = self.args.n_heads // self.args.n_kv_heads
            mask = visible.unsqueeze(1).repeat(1, 1, groups, 1)  # [B, 1, G*T, kv_len], rows ordered g*T + t
            read_rows = slice(None) if all_rows else rows.view(-1)
        return StepInputs(cos, sin, rows, positions, read_rows, kv_len, mask, exact_tokens)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, step: StepInputs, cache: KVCache,
                output_index: Optional[torch.Tensor] = None) -> torch.Tensor:
        """tokens [B, T] -> logits [B, T, V] through the first `cache.n_layers` layers.

        output_index [K]: keep only these tokens (flat indices b * T + t), as logits [K, 1, V]; prefill and
        drafting need only each user's last one.
        """
        x = self.tok_embeddings(tokens)
        for i in range(cache.n_layers):
            x = self.layers[i](x, step, cache.k[i], cache.v[i])
        if output_index is not None:
            x = x.flatten(0, 1)[output_index].unsqueeze(1)
        return self.output(self.norm(x))
