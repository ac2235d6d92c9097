# SPDX-License-Identifier: Apache-2.0
"""An EAGLE-3 draft head as a torch module beside our Transformer (its layout and files: checkpoints/eagle3_format.py),
and HeadRunner, which runs it in packed steps with a KV cache of its own: the DraftHeadModel the library's HeadDrafter
drafts with."""
from itertools import accumulate
from pathlib import Path
from typing import Optional, Sequence

import torch
from torch import nn

from ..checkpoints.eagle3_format import HeadConfig, estimated_run_cost, parameter_names, read_draft_head, write_head
from ..checkpoints.model_shape import ModelShape
from ..checkpoints.rope import rope_tables
from ..errors import check_int
from .attention import Attention, ExactToken, StepInputs
from .cpu_kernels import StepTable, kernels_fit
from .mlp import MLP
from .model import KernelLinear, KVCache, RMSNorm, Transformer

TREE_SLOTS = 64  # cache slots past max_seq_len for the nodes of a draft tree (each writes its own)


class HeadAttention(Attention):
    """The head layer's attention: on the CPU kernels the target's packed-step attention (attention_f32: a tree node
    sees the cache before the tree and its ancestors' slots, one pass over the cache for a user's rows); on torch ops
    one SDPA call per row, where a tree node reads its user's cache in place, as a chain token does: its path's K/V
    (ancestors' and its own tree slots, a few) are copied into the row's slots right after the cache before the tree,
    which then holds exactly its path's chain, read as one view (bit for bit the chain's keys). Gathering them as the
    target's tree nodes do copies the whole context once per node and run: three passes over the cache instead of
    one, a cost that grows with the context. Those slots are past the rows the head was fed: drafts write there, and
    the next feed rewrites them before any fed row reads them; nodes are attended one by one, so siblings taking
    turns in the slots do not meet."""

    def token_keys(self, tok: ExactToken, slots: Optional[torch.Tensor], k_cache: torch.Tensor,
                   v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if slots is None:
            return super().token_keys(tok, slots, k_cache, v_cache)
        path = slots[tok.run_end - tok.first :].to(k_cache.device)
        end = tok.run_end + len(path)
        if end > int(path.min()):
            raise ValueError(f"a tree node at position {tok.pos} would overwrite its own path's slots")
        for cache in (k_cache, v_cache):
            cache[tok.row, :, tok.run_end : end] = cache[tok.row][:, path]
        return k_cache[tok.row, :, tok.first : end], v_cache[tok.row, :, tok.first : end]


class Eagle3Layer(nn.Module):
    """The head's decoder layer: attention over [input_layernorm(embedding) ; hidden_norm(state)], the state (or its
    norm, norm_before_residual) as the residual, then the usual post-attention norm and SwiGLU MLP."""

    def __init__(self, args: ModelShape, dtype: torch.dtype, norm_before_residual: bool):
        super().__init__()
        self.norm_before_residual = norm_before_residual
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps, dtype)
        self.hidden_norm = RMSNorm(args.dim, args.norm_eps, dtype)
        self.attention = HeadAttention(args, dtype, in_dim=2 * args.dim)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps, dtype)
        self.feed_forward = MLP(args, dtype)

    def forward(self, embeds, state, step: StepInputs, k_cache, v_cache, keep: Optional[torch.Tensor] = None):
        """keep: the rows whose outputs are wanted (default all); the others only write their K/V."""
        normed = self.hidden_norm(state)
        residual = normed if self.norm_before_residual else state
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        h = (residual if keep is None else residual[:, keep]) + self.attention(x, step, k_cache, v_cache, keep)
        return h + self.feed_forward(self.ffn_norm(h))


class Eagle3Head(nn.Module):
    """fc over the taps, the layer, the norm and the draft-vocabulary LM head; `vocab` holds each draft id's target
    id. The embedding is borrowed from the target (not a submodule) unless the head ships its own."""

    def __init__(self, config: HeadConfig, embedding: nn.Module, dtype: torch.dtype,
                 d2t: Optional[torch.Tensor] = None):
        super().__init__()
        a = config.layer
        self.config, self.args, self.dtype = config, a, dtype
        n_in = len(config.taps) * config.target_hidden
        self.input_norm = RMSNorm(n_in, a.norm_eps, dtype) if config.norm_before_fc else None
        self.fc_norm = nn.ModuleList(RMSNorm(config.target_hidden, a.norm_eps, dtype) for _ in config.taps) \
            if config.fc_norm else None
        self.fc = nn.Linear(n_in, a.dim, bias=False, dtype=dtype)
        self.layer = Eagle3Layer(a, dtype, config.norm_before_residual)
        self.norm = RMSNorm(a.dim, a.norm_eps, dtype)
        self.lm_head = nn.Linear(a.dim, config.draft_vocab_size, bias=False, dtype=dtype)
        self.__dict__["embedding"] = embedding  # borrowed: never moved, cast or trained with the head
        ids = torch.arange(config.draft_vocab_size)
        self.register_buffer("vocab", ids + d2t.long() if d2t is not None else ids, persistent=False)
        self.kernels = None

    def features(self, states: torch.Tensor, next_tokens: torch.Tensor, step: StepInputs, k_cache, v_cache,
                 keep: Optional[torch.Tensor] = None):
        """[B, T, 3 * target hidden] taps (or [B, T, h], the head's own earlier outputs) and [B, T] next tokens ->
        the layer's outputs [B, T, h] (before the norm: what the next draft step reads); only the `keep` rows' with
        keep, [B, len(keep), h], the others writing their K/V alone."""
        state = self.project(states) if states.shape[-1] != self.args.dim else states
        out = self.layer(self.embedding(next_tokens).to(state.dtype), state, step, k_cache, v_cache, keep)
        return self.norm(out) if self.config.norm_output else out

    def project(self, taps: torch.Tensor) -> torch.Tensor:
        """The taps [..., 3 * target hidden] -> the first state [..., h] (fc, after the options' norms)."""
        if self.input_norm is not None:
            taps = self.input_norm(taps)
        if self.fc_norm is not None:
            taps = torch.cat([norm(x) for norm, x in zip(self.fc_norm, taps.chunk(len(self.fc_norm), dim=-1))], -1)
        return self.fc(taps)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """The layer's outputs (the state fed forward) -> float32 logits over the draft vocabulary."""
        return self.lm_head(out if self.config.norm_output else self.norm(out)).float()

    def use_cpu_kernels(self, kernels) -> None:
        """Every linear layer and the attention on the bf16 CPU kernels (the norms stay torch ops)."""
        self.fc = KernelLinear.from_linear(self.fc, kernels)
        self.lm_head = KernelLinear.from_linear(self.lm_head, kernels, torch.float32)
        attn, ffn = self.layer.attention, self.layer.feed_forward
        attn.wqkv, attn.wo = KernelLinear.from_linear(attn.wqkv, kernels), KernelLinear.from_linear(attn.wo, kernels)
        ffn.w_gate_up = KernelLinear.from_linear(ffn.w_gate_up, kernels)
        ffn.w_down = KernelLinear.from_linear(ffn.w_down, kernels)
        attn.kernels = self.kernels = kernels


def build_draft_head(config: HeadConfig, weights: dict, target: Transformer, device=None) -> Eagle3Head:
    """An Eagle3Head in the target's dtype beside it (its embedding unless the head ships one); on the CPU kernels
    when the target runs on them and they fit the head's layer (kernels_fit: its head_dim), else on torch ops."""
    dtype, device = target.dtype, device or target.device
    embed = weights.get("embed_tokens.weight")
    embedding = target.tok_embeddings
    if embed is not None:
        embedding = nn.Embedding.from_pretrained(embed.to(device, dtype), freeze=True)
    head = Eagle3Head(config, embedding, dtype, weights.get("d2t"))
    with torch.no_grad():
        for name, parts in parameter_names(config).items():
            head.get_parameter(name).copy_(torch.cat([weights[p] for p in parts]).to(dtype))
    head.to(device)
    if target.kernels is not None and device == target.device and kernels_fit(config.layer, dtype):
        head.use_cpu_kernels(target.kernels)
    return head.eval().requires_grad_(False)


def load_draft_head(value, target: Transformer, flag: str = "--draft_head") -> Eagle3Head:
    return build_draft_head(*read_draft_head(value, target.args, flag), target)


def head_tensors(head: Eagle3Head) -> dict[str, torch.Tensor]:
    """A head's tensors under speculators' names (bf16, d2t int64), from a head not on the CPU kernels."""
    out = {}
    for name, parts in parameter_names(head.config).items():
        weight = head.get_parameter(name).detach().to("cpu", torch.bfloat16)
        sizes = [weight.shape[0]] if len(parts) == 1 else (
            [head.args.n_heads * head.args.head_dim] + [head.args.n_kv_heads * head.args.head_dim] * 2
            if "wqkv" in name else [head.args.hidden_dim] * 2)
        out.update({p: w.contiguous() for p, w in zip(parts, weight.split(sizes))})
    if head.config.draft_vocab_size < head.args.vocab_size:
        out["d2t"] = (head.vocab.cpu() - torch.arange(len(head.vocab))).to(torch.int64)
        t2d = torch.zeros(head.args.vocab_size, dtype=torch.bool)
        t2d[head.vocab.cpu()] = True
        out["t2d"] = t2d
    return out


def save_draft_head(head: Eagle3Head, folder: Path, card: dict) -> None:
    """A trained head in speculators' layout, with its card."""
    write_head(folder, head.config, head_tensors(head), "speculators", card)


class HeadRunner:
    """The head with a KV cache of its own per user (one layer), run in packed steps like the target's: every row
    attends to exactly its own keys (on the kernels in one call, a user's rows in one pass; on torch ops through a call
    of its own), so its results do not depend on what else shares the run. Rows are chains (a
    user's consecutive positions) or tree nodes (each in its own slot past max_seq_len, seeing the user's cache
    before the tree and its ancestors). The `DraftHeadModel` of speculative/drafters/eagle3.py.

    draft_cost: one run relative to a target decode step (estimated_run_cost) until the drafter measures it.
    window: the positions a row attends back, its own included (WINDOW by default, None: the whole context; at most
    the head layer's own sliding window)."""

    max_rows = 256  # catch-up rows per user and run (a prompt goes in chunks)
    max_tree_nodes = TREE_SLOTS
    # A head learns attention over the sequences it was trained on (the shipped head: prompt + response within the
    # 1,024 positions tools/train_draft_head.py runs the target at). Keys further back made a run and the catch-up
    # after a long prompt grow with the context (docs/draft_sources.md, "The head's window").
    WINDOW = 1024

    def __init__(self, head: Eagle3Head, max_batch_size: int, max_seq_len: int, target_args: ModelShape,
                 window: Optional[int] = WINDOW):
        self.head, self.max_seq_len = head, max_seq_len
        window = max_seq_len if window is None else check_int("window", window, 1, fix="or None: the whole context")
        self.window = min(head.args.sliding_window or max_seq_len, window)
        a, config, device = head.args, head.config, head.norm.weight.device
        self.cache = KVCache(a, 1, max_batch_size, max_seq_len + 1 + TREE_SLOTS, head.dtype, device)
        self.tree_slot0 = max_seq_len + 1
        cos, sin = rope_tables(a, max_seq_len + 1, head.dtype)
        self.cos, self.sin = cos.to(device), sin.to(device)
        self.vocab, self.vocab_size, self.taps = head.vocab, a.vocab_size, config.taps
        self.draft_cost = estimated_run_cost(config, target_args)

    @torch.inference_mode()
    def _forward(self, exact: list[ExactToken], states: torch.Tensor, tokens: list[int], every_row: bool,
                 ends: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over packed rows: the layer's outputs and logits after each row [n, ...], or without every_row
        after each user's last [len(ends), ...]. Without every_row the others write their K/V (which depend on the row
        alone) and nothing else: a catch-up over a long prompt then costs fc and the K/V projection per row, not an
        attention over the whole cache (quadratic in the prompt), the output projection and the MLP."""
        dev, n = self.cos.device, len(exact)
        attending = exact if every_row else [exact[end - 1] for end in ends]
        keep = None if every_row else torch.tensor([end - 1 for end in ends], device=dev)
        rows, slots, pos = [t.row for t in exact], [t.slot for t in exact], [t.pos for t in exact]
        if n == 1 and self.head.kernels is None:
            # a padding partner writing the scratch slot, as TorchCausalLM._packed_step (oneDNN's M == 1 kernel)
            rows, slots, pos = rows * 2, slots + [self.cache.scratch_slot], pos * 2
            states, tokens = torch.cat([states, states]), tokens * 2
        if self.head.kernels is not None:  # every row rotated and written in C; a row that does not attend sees its
            # own key alone (its output is dropped), the others their keys
            kept = {t.index for t in attending}
            table = StepTable.of([t if t.index in kept else ExactToken(t.index, t.row, t.slot, t.pos, t.slot, t.slot + 1)
                                  for t in exact])
            step = StepInputs(self.cos, self.sin, None, None, None, 0, None, attending, exact_table=table)
        else:
            at = torch.tensor(pos, device=dev)
            step = StepInputs(self.cos[at].view(1, len(pos), 1, -1), self.sin[at].view(1, len(pos), 1, -1),
                              torch.tensor([rows], device=dev), torch.tensor([slots], device=dev), None, 0, None,
                              attending, [t.key_slots() for t in attending])
        out = self.head.features(states.unsqueeze(0).to(dev, self.head.dtype), torch.tensor([tokens], device=dev),
                                 step, self.cache.k[0], self.cache.v[0], keep)[0, : n if every_row else len(ends)]
        return out, self.head.logits(out)

    def run(self, users: Sequence[int], start_pos: Sequence[int], hidden: Sequence[torch.Tensor],
            next_tokens: Sequence[Sequence[int]], every_row: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per user, chain rows at start_pos, start_pos + 1, ...: the layer's output after its last row [1, h] and the
        draft-vocabulary logits after it [V'] (after every row, [n, h] and [n, V'], with every_row)."""
        window, exact = self.window, []
        for u, start, toks in zip(users, start_pos, next_tokens):
            for i in range(len(toks)):
                pos = start + i
                exact.append(ExactToken(len(exact), u, pos, pos, max(0, pos + 1 - window), pos + 1))
        ends = list(accumulate(len(toks) for toks in next_tokens))
        out, logits = self._forward(exact, torch.cat(list(hidden)), [t for toks in next_tokens for t in toks],
                                    every_row, ends)
        if every_row:
            return [(out[end - len(toks) : end], logits[end - len(toks) : end]) for toks, end in zip(next_tokens, ends)]
        return [(out[i : i + 1], logits[i]) for i in range(len(ends))]

    def run_tree(self, nodes: Sequence[tuple[int, int, int, tuple[int, ...]]], states: torch.Tensor,
                 tokens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Tree nodes (user, position, node number, ancestors' node numbers root first), each fed a state [n, h] and
        a token: it writes tree slot `node number` and sees the user's cache before `position - depth` and its
        ancestors. Returns the layer's outputs [n, h] and logits [n, V']."""
        window, exact = self.window, []
        for i, (u, pos, node, ancestors) in enumerate(nodes):
            if node >= TREE_SLOTS:
                raise ValueError(f"a head tree holds at most {TREE_SLOTS} nodes")
            first = max(0, pos + 1 - window)
            prefix_end = max(first, pos - len(ancestors))
            slots = tuple(self.tree_slot0 + a for a in (*ancestors, node))[-window:]  # a path longer than the window
            exact.append(ExactToken(i, u, self.tree_slot0 + node, pos, first, prefix_end, slots))
        return self._forward(exact, states, list(tokens), True, list(range(1, len(nodes) + 1)))
