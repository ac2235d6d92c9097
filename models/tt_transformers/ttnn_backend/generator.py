# SPDX-License-Identifier: Apache-2.0
"""The `CausalLM` contract on a Tenstorrent device, over a TT-Transformers model (model.py).

- prefill: TT-Transformers' own `Generator.prefill_forward_text` for one user (128-padded, chunked), into the
  user's page-table row; the last token's logits come back, as in tt-metal's text demo.
- step: ONE traced decode forward over the 32-row tile. Row r carries one token of one user at its position with
  the user's page-table row: a verification step is every user's [last token, d1..dK] at consecutive positions,
  attention bounded per row by its own position (paged SDPA decode); unused rows and idle users sit at position
  -1, which every op skips. Cache writes go in ordered passes (attention.py). Argmax runs on device over the
  vocabulary (the LM head's padded columns sliced off); only the 32 token ids are read back, and the logits only
  when sampling asks for them.
- hidden states (for a draft head, which runs on the host): a step asked for them also keeps the final norm's
  output, what the LM head reads, in DRAM ([1, 1, 32, dim] per step, read back as 32 rows x dim); a prefill asked
  for them replays the decode program over the prompt, 32 positions at a time, with every cache write switched off
  (all write-pass positions -1): the prompt's states come from the cache the prefill wrote, which stays as it was.
- traces: one per (write passes, top k, hidden) (passes 1, 2, 4, 8, 16, 32: the most rows any user has in the
  step), captured once after a compile run and replayed; every input is a persistent device tensor refreshed with
  `ttnn.copy_host_to_device_tensor`, so the loop allocates nothing on the device.
"""
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..speculative.backend import StepOutput, UserRows
from .model import TILE_ROWS, TTModel, supported_kwargs

# What a step costs, in units of one decode step of the tile: a step computes all 32 rows whatever is in them, so
# cost is a step function of tiles; each cache-write pass adds 2 small ops per layer (estimate, not measured: no
# device here; the hardware perf test records the real step times).
WRITE_PASS_COST = 0.01


def write_passes_for(rows_per_user: int) -> int:
    """Traces exist for 1, 2, 4, ... 32 passes: the smallest that covers the longest user."""
    passes = 1
    while passes < rows_per_user:
        passes *= 2
    return passes


@dataclass
class StepInputs:
    """The persistent device tensors every traced step reads (refreshed in place before each replay)."""

    tokens: Any
    current_pos: Any
    rope_idxs: Any
    page_table: Any
    pass_positions: list  # TILE_ROWS tensors of positions, -1 outside their pass


@dataclass
class Trace:
    trace_id: Any
    ids: Any  # [1, 1, 32] uint32 on device
    logits: Any  # [1, 1, 32, vocab] on device
    top_ids: Any  # [1, 1, 32, k] on device when the trace computes the top k, else None
    hidden: Any  # [1, 1, 32, dim] on device (DRAM) when the trace keeps the final hidden states, else None


class HiddenCapture:
    """Stands in for TT-Transformers' final norm (`Transformer.norm`, a DistributedNorm) while a traced step is
    captured: the norm runs as before and its output, the LM head's input, is also copied to DRAM, an output of the
    trace like the logits. Outside the Galaxy layout the norm's decode output holds every row's whole hidden state
    on each device (DistributedNorm gathers it for the LM head)."""

    def __init__(self, norm):
        self.norm, self.output = norm, None

    def __call__(self, x, *args, **kwargs):
        import ttnn

        out = self.norm(x, *args, **kwargs)
        self.output = ttnn.to_memory_config(out, memory_config=ttnn.DRAM_MEMORY_CONFIG)
        return out


class TtnnCausalLM:
    """A TT-Transformers model (or a view of its first layers) behind the CausalLM contract."""

    def __init__(self, tt: TTModel, max_batch_size: int, max_seq_len: int, shares_target_cache: bool = False):
        if not 1 <= max_batch_size <= TILE_ROWS:
            raise ValueError(f"--batch_size {max_batch_size}: a TT decode step holds at most {TILE_ROWS} users "
                             "(one 32-row tile); use 32 or fewer")
        self.tt, self.max_batch_size, self.max_seq_len = tt, max_batch_size, max_seq_len
        self.n_layers, self.vocab_size = tt.n_layers, tt.args.vocab_size
        self.max_step_rows = TILE_ROWS
        # Token trees need each row to see its ancestors only, which paged SDPA decode (each row sees every cached
        # position up to its own) does not express without an attention mask per step: chains only (README).
        self.supports_trees = False
        self.shares_target_cache = shares_target_cache
        self.device = torch.device("cpu")  # where the logits it returns live
        self.inputs = None
        self.traces: dict[tuple[int, int, bool], Trace] = {}  # (write passes, top k, hidden) -> trace

    def draft_view(self, n_layers: int) -> "TtnnCausalLM":
        """The first n_layers layers on the target's weights and cache (no copy, no catch-up), traced apart."""
        if not 1 <= n_layers < self.n_layers:
            raise ValueError(f"a draft view needs 1 to {self.n_layers - 1} layers, got {n_layers}")
        return TtnnCausalLM(self.tt.first_layers(n_layers), self.max_batch_size, self.max_seq_len,
                            shares_target_cache=True)

    def step_cost(self, n_rows: int, context_len: float) -> float:
        tiles = -(-n_rows // TILE_ROWS)
        return tiles * (1 + WRITE_PASS_COST * write_passes_for(min(n_rows, TILE_ROWS)))

    def prefill(self, user: int, tokens: Sequence[int], logits: bool = False, hidden: bool = False) -> StepOutput:
        generator = self.tt.generator
        out = generator.prefill_forward_text(torch.tensor([list(tokens)]), **supported_kwargs(
            generator.prefill_forward_text, page_table=self.tt.page_table[user : user + 1], kv_cache=[self.tt.kv_cache],
            prompt_lens=[len(tokens)], empty_slots=[user], enable_trace=False))
        row = out.reshape(-1)[: self.vocab_size].float().view(1, -1)
        states = None
        if hidden:  # the decode program over the prompt, 32 positions a step, writing nothing
            states = [torch.cat([self._run([UserRows(user, list(tokens[i : i + TILE_ROWS]), i)], False, 0, True,
                                           write=False).hidden[0] for i in range(0, len(tokens), TILE_ROWS)])]
        return StepOutput([row.argmax(dim=-1).tolist()], [row] if logits else None, hidden=states)

    def commit_path(self, user: int, start_pos: int, path: Sequence[int]) -> None:
        raise NotImplementedError("the ttnn backend verifies chains only (supports_trees is False)")

    def step(self, rows: Sequence[UserRows], logits: bool = False, top_k: int = 0, hidden: bool = False
             ) -> StepOutput:
        if any(r.parents is not None for r in rows):
            raise ValueError("the ttnn backend verifies chains only (supports_trees is False)")
        return self._run(rows, logits, top_k, hidden)

    def _run(self, rows: Sequence[UserRows], logits: bool, top_k: int, hidden: bool, write: bool = True
             ) -> StepOutput:
        """One replay of the decode trace over `rows` (write=False: no cache writes, all pass positions -1)."""
        import ttnn

        n_rows = sum(len(r.tokens) for r in rows)
        if n_rows > TILE_ROWS:
            raise ValueError(f"a step of {n_rows} rows does not fit the {TILE_ROWS}-row decode tile")
        if hidden and self.tt.args.is_galaxy:
            raise ValueError("hidden states on a Galaxy: its final norm leaves each device a slice of them, which "
                             "this backend does not gather; use a draft mode without a draft head there")
        tokens = torch.zeros(TILE_ROWS, dtype=torch.int64)
        positions = torch.full((TILE_ROWS,), -1, dtype=torch.int64)
        page_table = self.tt.page_table[0].repeat(TILE_ROWS, 1)  # idle rows: any valid row, never read
        pass_positions = torch.full((TILE_ROWS, TILE_ROWS), -1, dtype=torch.int32)
        r = 0
        for user_rows in rows:
            for j, token in enumerate(user_rows.tokens):
                tokens[r], positions[r] = token, user_rows.start_pos + j
                page_table[r] = self.tt.page_table[user_rows.user]
                if write:
                    pass_positions[j, r] = positions[r]
                r += 1
        host = self.tt.model.prepare_decode_inputs_host(tokens, positions, page_table)
        host_passes = [ttnn.from_torch(p, dtype=ttnn.int32, mesh_mapper=self._positions_mapper()) for p in pass_positions]
        self._refresh_inputs(host, host_passes)
        passes = write_passes_for(max(len(u.tokens) for u in rows)) if write else 1
        trace = self._trace(passes, top_k, hidden)
        ttnn.execute_trace(self.tt.mesh_device, trace.trace_id, cq_id=0, blocking=False)
        ids = ttnn.to_torch(ttnn.get_device_tensors(trace.ids)[0]).reshape(-1)[:r].tolist()
        all_logits = None
        if logits:
            all_logits = ttnn.to_torch(ttnn.get_device_tensors(trace.logits)[0]).float().reshape(TILE_ROWS, -1)
        top = ttnn.to_torch(ttnn.get_device_tensors(trace.top_ids)[0]).reshape(TILE_ROWS, -1) if top_k else None
        states = None
        if hidden:
            states = ttnn.to_torch(ttnn.get_device_tensors(trace.hidden)[0]).reshape(TILE_ROWS, -1)[:, : self.tt.args.dim]
        out_ids, out_logits, out_top, out_hidden, start = [], [], [], [], 0
        for user_rows in rows:
            end = start + len(user_rows.tokens)
            out_ids.append([int(i) for i in ids[start:end]])
            if logits:
                out_logits.append(all_logits[start:end, : self.vocab_size])
            if top_k:
                out_top.append(top[start:end, :top_k].long().tolist())
            if hidden:
                out_hidden.append(states[start:end].to(torch.bfloat16))
            start = end
        return StepOutput(out_ids, out_logits if logits else None, out_top if top_k else None,
                          out_hidden if hidden else None)

    def _positions_mapper(self):
        """How TT-Transformers places the decode positions on the mesh (prepare_decode_inputs_host): replicated,
        or split over the mesh rows on a Galaxy."""
        import ttnn

        args = self.tt.args
        return ttnn.ShardTensor2dMesh(self.tt.mesh_device, dims=(None, 0) if args.is_galaxy else (None, None),
                                      mesh_shape=args.cluster_shape)

    def _refresh_inputs(self, host: tuple, host_passes: list) -> None:
        """First step: put the inputs on the device (TT-Transformers' copy_host_to_device). Later steps copy into
        the same tensors: the traces read them, and nothing is allocated."""
        import ttnn
        from models.tt_transformers.tt.common import copy_host_to_device

        if self.inputs is None:
            device = copy_host_to_device([*host, *host_passes], mesh_device=self.tt.mesh_device)
            self.inputs = StepInputs(*device[:4], device[4:])
            return
        targets = [self.inputs.tokens, self.inputs.current_pos, self.inputs.rope_idxs, self.inputs.page_table,
                   *self.inputs.pass_positions]
        for source, target in zip([*host, *host_passes], targets):
            ttnn.copy_host_to_device_tensor(source, target)

    def _forward(self, top_k: int, hidden: bool) -> list:
        """The traced program: the decode forward over the tile, then argmax (and the top k ids) on device; with
        `hidden`, the final norm's output too (HiddenCapture)."""
        import ttnn

        i, model = self.inputs, self.tt.model
        capture = HiddenCapture(model.norm) if hidden else None
        if capture:
            model.norm = capture
        try:
            out, _ = model.ttnn_decode_forward(i.tokens, i.current_pos, rot_mat_idxs=i.rope_idxs,
                                               page_table=i.page_table, kv_cache=self.tt.kv_cache)
        finally:
            if capture:
                model.norm = capture.norm
        logits = ttnn.slice(out, [0, 0, 0, 0], [1, 1, TILE_ROWS, self.vocab_size])  # drop padded vocab columns
        outputs = [ttnn.argmax(logits, dim=-1), logits]
        outputs.append(ttnn.topk(ttnn.to_layout(logits, ttnn.TILE_LAYOUT), k=top_k, dim=-1)[1] if top_k else None)
        outputs.append(capture.output if capture else None)
        return outputs

    def _trace(self, passes: int, top_k: int, hidden: bool) -> Trace:
        import ttnn

        key = (passes, top_k, hidden)
        if key not in self.traces:
            mesh = self.tt.mesh_device
            self.tt.passes.positions = self.inputs.pass_positions[:passes]
            for tensor in self._forward(top_k, hidden):  # compile run: programs are built before a trace records them
                if tensor is not None:
                    ttnn.deallocate(tensor)
            trace_id = ttnn.begin_trace_capture(mesh, cq_id=0)
            outputs = self._forward(top_k, hidden)
            ttnn.end_trace_capture(mesh, trace_id, cq_id=0)
            self.traces[key] = Trace(trace_id, *outputs)
        return self.traces[key]

    def release(self) -> None:
        import ttnn

        for trace in self.traces.values():
            ttnn.release_trace(self.tt.mesh_device, trace.trace_id)
        self.traces = {}
