# SPDX-License-Identifier: Apache-2.0
"""Compact Llama/Mistral decoder (gpt-fast style) with a static KV cache that lives outside the weights.

Keeping the cache outside the modules lets a draft made of the first N layers share every weight
tensor with the target while owning a cache of its own.
"""
import copy
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoints.checkpoint import Checkpoint
from ..checkpoints.model_shape import ModelShape
from ..checkpoints.rope import rope_tables
from .attention import Attention, ExactToken, StepInputs
from .cpu_isa import onednn_bf16_dot_products, onednn_bf16_prepacking
from .cpu_kernels import CpuKernels, PrefillTable, StepTable, kernels_fit
from .mlp import MLP


PREFILL_CHUNK = 512  # queries per fused attention call in a prefill (its mask: 512 x the keys they see)


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
    """bf16 on a CPU whose oneDNN runs bf16 (cpu_isa.onednn_bf16_prepacking: AVX-512 BW/VL/DQ, aarch64 BF16)."""
    return dtype == torch.bfloat16 and torch.device(device).type == "cpu" and onednn_bf16_prepacking()


class PackedLinear(nn.Module):
    """A bf16 CPU linear layer whose weight is reordered for oneDNN once, instead of on every call.

    F.linear reorders the weight each call, which halves the rate at which the per-layer weights stream from
    memory. Prepacked, the matmul runs at about twice the rate and costs nearly the same from 1 to 17 rows,
    which is what makes verifying drafts cheap; results equal F.linear's bit for bit and do not depend on how
    many rows share the call (tests/torch_backend/test_row_invariance.py).
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [None], "")


def raise_if_on_kernels(module: nn.Module) -> None:
    """Modules on the CPU kernels refuse .to() and casts (nn.Module._apply): the kernels read their tensors as raw
    bf16 CPU memory."""
    raise RuntimeError(f"{type(module).__name__} runs on the bf16 CPU kernels and cannot be moved or cast; load the "
                       "model again with the device and dtype you want (load_model(..., device=, cpu_kernels=False))")


class KernelLinear(nn.Module):
    """A bf16 CPU linear layer on cpu_kernels.c: weights packed once, streamed at close to memory bandwidth, each
    output accumulated in an order that does not depend on the number of rows. The packed weight is a buffer, so
    a deep copy or `.to()` carries it along; the kernels take its address at each call, never earlier."""

    def __init__(self, packed: torch.Tensor, out_features: int, kernels: CpuKernels,
                 out_dtype: torch.dtype = torch.bfloat16, onednn: bool = False):
        super().__init__()
        self.kernels, self.out_dtype, self.out_features = kernels, out_dtype, out_features
        self.onednn = onednn  # through torch's oneDNN matmul instead (TransformerBlock's: prefill rows only)
        self.register_buffer("packed", packed, persistent=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, kernels: CpuKernels, out_dtype: torch.dtype = torch.bfloat16):
        return cls(kernels.pack_weight(linear.weight), linear.out_features, kernels, out_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.onednn:  # the weight unpacked for the call: one copy of it against a prompt's many rows
            return F.linear(x, self.kernels.unpack_weight(self.packed, self.out_features)).to(self.out_dtype)
        return self.kernels.linear(x, self.packed, self.out_features, self.out_dtype)

    def _apply(self, fn, recurse=True):
        raise_if_on_kernels(self)


class KernelEmbedding(nn.Module):
    """Token embeddings read from a tied LM head's packed weight, so a tied model keeps one copy of the matrix."""

    def __init__(self, head: KernelLinear):
        super().__init__()
        self.head = head

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head.kernels.packed_rows(self.head.packed, tokens)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelShape, dtype: torch.dtype):
        super().__init__()
        self.args = args
        self.attention_norm = RMSNorm(args.dim, args.norm_eps, dtype)
        self.attention = Attention(args, dtype)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps, dtype)
        self.feed_forward = MLP(args, dtype)
        self.kernels: Optional[CpuKernels] = None  # set by use_cpu_kernels, with kernel_weights
        self.kernel_weights: tuple = ()

    LINEARS = ("attention.wqkv", "attention.wo", "feed_forward.w_gate_up", "feed_forward.w_down")

    def _linears(self):
        """(parent module, attribute, name) of every linear layer."""
        for name in self.LINEARS:
            parent, attr = name.split(".")
            yield getattr(self, parent), attr, name

    def use_cpu_kernels(self, kernels: CpuKernels, packed: Optional[dict[str, torch.Tensor]] = None) -> None:
        """Every linear layer on the kernels, and the whole block of a packed step in one kernel call. `packed`: the
        weights already packed (by name in LINEARS), as load_model reads them; otherwise packed from the layers.

        The linear modules then serve only the masked path, a prefill's many rows: where torch's oneDNN runs bf16 dot
        products (onednn_bf16_dot_products) they go through its matmul, whose blocked kernels (AMX tiles on the Xeons
        that have them) the kernels' row tiles, built to stream the weights for a few rows, do not match in arithmetic;
        elsewhere the kernels' linear layer is the faster."""
        onednn = onednn_bf16_dot_products()
        for parent, attr, name in self._linears():
            weight = packed[name] if packed else kernels.pack_weight(getattr(parent, attr).weight)
            setattr(parent, attr, KernelLinear(weight, getattr(parent, attr).out_features, kernels, onednn=onednn))
        # The tensors themselves, not their addresses: a deep copy gets its own, and _apply below forbids moves.
        self.kernel_weights = (self.attention_norm.weight, self.attention.wqkv.packed, self.attention.wo.packed,
                               self.ffn_norm.weight, self.feed_forward.w_gate_up.packed, self.feed_forward.w_down.packed)
        kernels.check_layer_weights(self.args, self.kernel_weights)
        self.kernels = self.attention.kernels = kernels

    def _apply(self, fn, recurse=True):
        if self.kernels is not None:
            raise_if_on_kernels(self)
        return super()._apply(fn, recurse)

    def prepack_linears(self) -> None:
        """Every linear layer as a PackedLinear (bf16 on CPU, torch ops)."""
        for parent, attr, _ in self._linears():
            setattr(parent, attr, PackedLinear(getattr(parent, attr)))

    def forward(self, x, step: StepInputs, k_cache, v_cache):
        if step.exact_table is not None:
            return self.kernels.decoder_layer(x, self.args, self.kernel_weights, step.exact_table, step.cos,
                                              step.sin, k_cache, v_cache)
        if step.prefill_table is not None:  # a prefill on the kernels: the norms and SwiGLU too (torch's took 1.5-3x)
            kernels, ffn, eps = self.kernels, self.feed_forward, self.args.norm_eps
            h = x + self.attention(kernels.rms_norm(x, self.attention_norm.weight, eps), step, k_cache, v_cache)
            return h + ffn.w_down(kernels.silu_mul(ffn.w_gate_up(kernels.rms_norm(h, self.ffn_norm.weight, eps))))
        h = x + self.attention(self.attention_norm(x), step, k_cache, v_cache)
        return h + self.feed_forward(self.ffn_norm(h))


class KVCache:
    """Per-layer K/V tensors [users, n_kv_heads, max_seq_len + 1, head_dim].

    The extra last slot is scratch: padding tokens of a ragged batch write there and nothing reads it.
    """

    def __init__(self, args: ModelShape, n_layers: int, n_users: int, max_seq_len: int, dtype, device):
        shape = (n_users, args.n_kv_heads, max_seq_len + 1, args.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.n_layers, self.n_users, self.max_seq_len = n_layers, n_users, max_seq_len
        self.scratch_slot = max_seq_len

    def first_layers(self, n_layers: int) -> "KVCache":
        """A view of this cache's first n_layers layers (same tensors): a truncated draft's share of it."""
        view = copy.copy(self)
        view.k, view.v, view.n_layers = self.k[:n_layers], self.v[:n_layers], n_layers
        return view


class Transformer(nn.Module):
    def __init__(self, args: ModelShape, dtype: torch.dtype = torch.bfloat16, max_seq_len: int = 2048):
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
        self.checkpoint: Optional[Checkpoint] = None  # load_model's: the draft head shipped for it goes by its name
        self.init_rope(self.norm.weight.device)

    def init_rope(self, device) -> None:
        """(Re)build the rotary tables on `device`; needed after building the modules on the meta device."""
        cos, sin = rope_tables(self.args, self.max_seq_len + 1, self.dtype)  # + the scratch slot
        self.register_buffer("rope_cos", cos.to(device), persistent=False)
        self.register_buffer("rope_sin", sin.to(device), persistent=False)

    def supports_cpu_kernels(self, device=None) -> bool:
        """Whether the kernels can run this model on `device` (default: where it is now)."""
        device = torch.device(device) if device is not None else self.device
        return device.type == "cpu" and kernels_fit(self.args, self.dtype)

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def use_cpu_kernels(self, kernels: CpuKernels) -> None:
        """Run every linear layer on the bf16 CPU kernels (the LM head too, with float32 logits), and every layer of
        a packed step (decode, verification) in one kernel call (load_model does this layer by layer as it loads)."""
        for layer in self.layers:
            layer.use_cpu_kernels(kernels)
        self.use_cpu_kernels_for_head(kernels)

    def use_cpu_kernels_for_head(self, kernels: CpuKernels, packed: Optional[torch.Tensor] = None) -> None:
        """The LM head on the kernels (`packed`: its weight already packed); a tied embedding then reads its rows
        from the packed head (one copy)."""
        self.kernels = kernels
        self.output = (KernelLinear(packed, self.args.vocab_size, kernels, torch.float32) if packed is not None else
                       KernelLinear.from_linear(self.output, kernels, torch.float32))
        if self.args.tie_word_embeddings:
            self.tok_embeddings = KernelEmbedding(self.output)

    def prepack_linears(self) -> None:
        """Swap every layer's linear for a PackedLinear (bf16 on CPU). The LM head stays as it is: F.linear already
        streams that one large matrix at full speed, and a tied head shares its tensor with the embedding."""
        for layer in self.layers:
            layer.prepack_linears()

    def new_cache(self, n_layers: int, n_users: int) -> KVCache:
        return KVCache(self.args, n_layers, n_users, self.max_seq_len, self.dtype, self.device)

    def step_inputs(self, positions: torch.Tensor, query_pos: Optional[torch.Tensor], rows: torch.Tensor, kv_len: int,
                    all_rows: bool, exact_tokens: Optional[list[ExactToken]] = None,
                    rope_positions: Optional[torch.Tensor] = None) -> StepInputs:
        """Per-step tensors shared by all layers.

        positions [B, T]: the cache slot each token writes; rope_positions: its position (default: the slot; a
        token tree's nodes write slots past their positions); rows [B, 1] (or [B, T]): its cache row; query_pos
        [B, T]: the position it attends from (padding tokens write the scratch slot and attend like the last real
        token). all_rows: the batch is every cache row in order, so attention reads a view. exact_tokens: see
        StepInputs; when given, no mask is built and rows may differ per token (a packed step). The caller decides
        these from host-side ints, so nothing here syncs a device but a masked step's one read of its query
        positions (prefill_chunks).
        """
        if exact_tokens is not None and self.kernels is not None:  # the kernel gathers the rotary tables itself
            return StepInputs(self.rope_cos, self.rope_sin, rows, positions, None, kv_len, None, exact_tokens,
                              exact_table=StepTable.of(exact_tokens))
        if exact_tokens is None and self.kernels is not None and rope_positions is None:  # the kernels' prefill:
            # every query at once, no mask, each rotated at its slot (rope_positions elsewhere: the torch path below)
            table = PrefillTable.of(rows, query_pos, self.args.sliding_window, slots=positions)
            return StepInputs(self.rope_cos, self.rope_sin, rows, positions, None, kv_len, None, prefill_table=table)
        at = rope_positions if rope_positions is not None else positions
        cos, sin = self.rope_cos[at].unsqueeze(2), self.rope_sin[at].unsqueeze(2)
        if exact_tokens is not None:
            return StepInputs(cos, sin, rows, positions, None, kv_len, None, exact_tokens,
                              [tok.key_slots() for tok in exact_tokens])
        read_rows = slice(None) if all_rows else rows.view(-1)
        return StepInputs(cos, sin, rows, positions, read_rows, kv_len, self.prefill_chunks(query_pos))

    def prefill_chunks(self, query_pos: torch.Tensor) -> list[tuple[int, int, int, int, torch.Tensor]]:
        """StepInputs.chunks of a masked step: PREFILL_CHUNK queries at a time, each with the keys its queries see
        (up to the chunk's last position, from its first one's window) and their additive mask in the model's dtype
        (SDPA would convert a boolean one at every call). Built once a step and shared by the layers; the mask then
        spans a causal prompt's lower half (about T * T / 2 elements), where one mask for the whole prompt spanned
        all of it, G times over. Reads the query positions on the host once."""
        window, dev = self.args.sliding_window, query_pos.device
        first, last = query_pos.amin(dim=0).tolist(), query_pos.amax(dim=0).tolist()
        chunks = []
        for q0 in range(0, query_pos.shape[1], PREFILL_CHUNK):
            q1 = min(q0 + PREFILL_CHUNK, query_pos.shape[1])
            k0, k1 = max(0, min(first[q0:q1]) + 1 - window) if window else 0, max(last[q0:q1]) + 1
            key_pos, seen = torch.arange(k0, k1, device=dev), query_pos[:, q0:q1, None]
            visible = key_pos <= seen
            if window is not None:
                visible &= key_pos > seen - window
            mask = torch.zeros(visible.shape, dtype=self.dtype, device=dev).masked_fill_(~visible, float("-inf"))
            chunks.append((q0, q1, k0, k1, mask.unsqueeze(1)))
        return chunks

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, step: StepInputs, cache: KVCache,
                output_index: Optional[torch.Tensor] = None, taps: Sequence[int] = ()):
        """tokens [B, T] -> logits [B, T, V] through the first `cache.n_layers` layers.

        output_index [K]: logits only for these tokens (flat indices b * T + t), as [K, 1, V]; prefill and drafting
        need only each user's last one. taps: also return the residual stream entering each of these layers for
        every token (cache.n_layers: the last layer's output), concatenated [B, T, len(taps) * dim] (what an EAGLE-3
        draft head reads).
        """
        x = self.tok_embeddings(tokens)
        tapped = {}
        for i in range(cache.n_layers):
            if i in taps:
                tapped[i] = x
            x = self.layers[i](x, step, cache.k[i], cache.v[i])
        tapped[cache.n_layers] = x
        normed = self.norm(x)  # row by row: the same values whether or not other rows are kept
        logits = self.output(normed.flatten(0, 1)[output_index].unsqueeze(1) if output_index is not None else normed)
        return (logits, torch.cat([tapped[i] for i in taps], dim=-1)) if taps else logits
