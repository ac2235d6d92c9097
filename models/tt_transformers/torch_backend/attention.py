# SPDX-License-Identifier: Apache-2.0
"""Grouped-query attention over a static, preallocated KV cache."""
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoints.model_shape import ModelShape


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D]; cos/sin [B, T, 1, D] gathered at each token's position."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@dataclass(frozen=True)
class ExactToken:
    """A token of a packed step (decode, verification, draft catch-up) and exactly the keys it sees: cache slots
    [first, run_end) and then `ancestors` (slots, in depth order). A chain token sees [first, slot] (run_end = slot + 1,
    no ancestors); a node of a token tree sees the cache before the tree and then its ancestors' slots and its own,
    the same values in the same order as the chain of its path, so its result is bit-identical to that chain's."""

    index: int  # where it sits in the packed row
    row: int  # cache row (user)
    slot: int  # the cache slot it writes
    pos: int  # its position (rotary)
    first: int
    run_end: int
    ancestors: tuple[int, ...] = ()

    def key_slots(self) -> Optional[torch.Tensor]:
        """The slots to gather for a tree node; None for a chain token (a contiguous slice)."""
        if not self.ancestors:
            return None
        return torch.cat((torch.arange(self.first, self.run_end), torch.tensor(self.ancestors, dtype=torch.long)))


@dataclass
class StepInputs:
    """Everything a forward step shares across layers, computed once per step (not per layer)."""

    cos: torch.Tensor  # [B, T, 1, D] rotary tables at each token's position (whole tables [slots, D] on the kernels)
    sin: torch.Tensor
    rows: torch.Tensor  # [B, 1] cache row (user) of each batch entry, or [B, T] per token in a packed step
    positions: torch.Tensor  # [B, T] cache slot each token writes
    read_rows: Union[slice, torch.Tensor, None]  # rows the masked path reads: a slice when it is a view
    kv_len: int  # attention reads cache slots [0, kv_len)
    # The masked path (prefill), one fused attention call per chunk of queries: (first query, end, first key, end
    # key, additive mask [B, 1, queries, keys] in the model's dtype) each, built once a step (Transformer.step_inputs).
    chunks: Optional[list[tuple[int, int, int, int, torch.Tensor]]]
    # Exact mode, for a packed step [1, N]: every real token with the keys it sees, each attended by its own SDPA
    # call. A token's result then never depends on what else shares the step (CPU flash attention is not
    # row-invariant), so verifying n drafts reproduces n one-token decodes bit for bit. None: one batched, masked
    # call (prefill).
    exact_tokens: Optional[list[ExactToken]] = None
    exact_keys: Optional[list[Optional[torch.Tensor]]] = None  # ExactToken.key_slots of each, computed once a step
    # The same for the CPU kernels (Transformer.use_cpu_kernels): a TransformerBlock's whole layer then runs in one
    # kernel call, a draft head's attention in one step_attention call.
    exact_table: Optional["StepTable"] = None
    # The masked step on the CPU kernels: every query in one prefill_attention call (no chunks, no mask).
    prefill_table: Optional["PrefillTable"] = None


class Attention(nn.Module):
    def __init__(self, args: ModelShape, dtype: torch.dtype, in_dim: Optional[int] = None):
        super().__init__()  # in_dim: what q/k/v read when not the model's width (an EAGLE-3 head's 2 * dim)
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        qkv_dim = (args.n_heads + 2 * args.n_kv_heads) * args.head_dim
        self.wqkv = nn.Linear(in_dim or args.dim, qkv_dim, bias=False, dtype=dtype)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False, dtype=dtype)
        self.kernels = None  # the CPU kernels (TransformerBlock.use_cpu_kernels): a prefill's attention runs on them

    def forward(self, x: torch.Tensor, step: StepInputs, k_cache: torch.Tensor, v_cache: torch.Tensor,
                keep: Optional[torch.Tensor] = None) -> torch.Tensor:
        """keep (exact steps): the tokens whose outputs are wanted, [B, len(keep), dim]; every token still writes its
        K/V (a draft head's catch-up rows feed only its cache)."""
        B, T, _ = x.shape
        H, Hk, D = self.n_heads, self.n_kv_heads, self.head_dim
        if step.prefill_table is not None:  # on the CPU kernels: rotary, cache writes and attention in C
            table = step.prefill_table
            q = self.kernels.prefill_rotate(self.wqkv(x), H, table, step.cos, step.sin, k_cache, v_cache)
            return self.wo(self.kernels.prefill_attention(q, k_cache, v_cache, table).view(B, T, H * D))
        if step.exact_table is not None:  # a packed step [1, T] on the CPU kernels (a draft head's layer: a
            # TransformerBlock's runs whole in decoder_layer): rotary, cache writes and attention in C, rounded as there
            out = self.kernels.step_attention(self.wqkv(x).view(T, -1), H, step.exact_table, step.cos, step.sin,
                                              k_cache, v_cache).to(x.dtype).view(B, T, H * D)
            return self.wo(out if keep is None else out[:, keep])
        qkv = self.wqkv(x).view(B, T, H + 2 * Hk, D)
        qk = apply_rope(qkv[:, :, : H + Hk], step.cos, step.sin)  # one rotary pass for q and k heads
        q, k, v = qk[:, :, :H], qk[:, :, H:], qkv[:, :, H + Hk :]
        # Cache layout [users, Hk, slots, D]; rollback after a rejected draft is by position only.
        k_cache[step.rows, :, step.positions] = k
        v_cache[step.rows, :, step.positions] = v
        G = H // Hk
        if step.exact_tokens is not None:
            out = torch.zeros(B, T, H, D, dtype=x.dtype, device=x.device)  # padding tokens attend to nothing
            for tok, slots in zip(step.exact_tokens, step.exact_keys):
                keys, values = self.token_keys(tok, slots, k_cache, v_cache)
                # reshape, not view: on CUDA the query rows and SDPA's output need not be contiguous there
                out[0, tok.index] = F.scaled_dot_product_attention(
                    q[0, tok.index].reshape(1, Hk, G, D), keys.unsqueeze(0), values.unsqueeze(0)).reshape(H, D)
            out = out.view(B, T, H * D)
            return self.wo(out if keep is None else out[:, keep])
        keys, values = k_cache[step.read_rows, :, : step.kv_len], v_cache[step.read_rows, :, : step.kv_len]
        q = q.transpose(1, 2)
        out = torch.empty(B, H, T, D, dtype=x.dtype, device=x.device)
        for q0, q1, k0, k1, mask in step.chunks:  # each chunk reads only the keys it sees (causal: half the work)
            out[:, :, q0:q1] = F.scaled_dot_product_attention(q[:, :, q0:q1], keys[:, :, k0:k1], values[:, :, k0:k1],
                                                              attn_mask=mask, enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(B, T, H * D))

    def token_keys(self, tok: ExactToken, slots: Optional[torch.Tensor], k_cache: torch.Tensor,
                   v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values [Hk, n, D] an exact step's token sees: a view of its row's run, or a tree node's
        slots gathered (slots: ExactToken.key_slots)."""
        if slots is None:
            return k_cache[tok.row, :, tok.first : tok.run_end], v_cache[tok.row, :, tok.first : tok.run_end]
        return k_cache[tok.row][:, slots], v_cache[tok.row][:, slots]
