# SPDX-License-Identifier: Apache-2.0
"""The `CausalLM` contract on a Tenstorrent device, over a TT-Transformers model (model.py).

- prefill: TT-Transformers' own `Generator.prefill_forward_text` for one user (padded, chunked), into the user's
  page-table row; the last token's logits come back, as in tt-metal's text demo. Its first call runs TT's prefill
  warm-up sweep, which `warm_up` triggers before anything is timed.
- step: ONE traced decode forward over the 32-row tile. Row r carries one token of one user at its position with
  the user's page-table row: a verification step is every user's [last token, d1..dK] at consecutive positions,
  attention bounded per row by its own position (paged SDPA decode); unused rows and idle users sit at position
  -1, which every op skips. Cache writes go in ordered passes (attention.py).
- argmax on device, per device: on one device (or where TT gathers the logits: a Galaxy, or no on-device sampling
  support) over the LM head's output with the padded columns sliced off; on N300/T3K-style meshes each device takes
  the argmax and the max of its own vocabulary share (padded columns masked to -inf) and only 32 ids and 32 values
  per device come back, merged on the host, instead of TT's all-gather of every logit (`ttnn_decode_forward` with
  `sampling_on_device=True, capture_sampling_trace=True` returns the per-device shares: TT's split-sampling hook).
  The logits come back only when sampling asks for them.
- top k (token recycling): `ttnn.topk` runs multi-core only on power-of-two widths (trace_plan.vocab_slices); each
  device's vocabulary share is cut into slices of such a width (the last padded with -inf), the top k of each taken
  on device, and the few candidates merged on the host.
- hidden states (for a draft head, which runs on the host): a step asked for them also keeps the final norm's
  output, what the LM head reads, in DRAM ([1, 1, 32, dim] per step, read back as 32 rows x dim); a prefill asked
  for them replays the decode program over the prompt, 32 positions at a time, with every cache write switched off
  (all write-pass positions -1): the prompt's states come from the cache the prefill wrote, which stays as it was.
- traces: one per (write passes, top k, hidden) for the pass counts a run can need (trace_plan.pass_ladder), all
  compiled and captured by `warm_up` before anything is timed (checked against the mesh's trace region first), and
  replayed; every input is a persistent device tensor refreshed with `ttnn.copy_host_to_device_tensor` (only the
  pass tensors the trace reads), so the loop allocates nothing on the device.
"""
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from ..speculative.backend import StepOutput, UserRows
from .device import TRACE_REGIONS
from .model import TILE_ROWS, TTModel, supported_kwargs
from .trace_plan import pass_ladder, passes_for, region_bytes, trace_bytes, trace_keys, vocab_slices

# What a step costs, in units of streaming the weights once (a decode step of the tile, which computes all 32 rows
# whatever is in them): each cache-write pass adds two paged_update_cache ops per layer, and paged SDPA decode reads
# each active row's cached keys, so its work grows with rows x context. Estimates (no device here): the hardware
# perf test records the step time of every traced shape (TtnnCausalLM.step_times) to replace them.
WRITE_PASS_COST = 0.01
KEY_COST = 2e-6  # per row per cached position
# Trace bytes captured so far per mesh (id(mesh) -> bytes), over every model on it: the target and its draft views.
TRACE_BYTES: defaultdict = defaultdict(int)


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
    bytes: int  # its estimated share of the trace region
    ids: Any  # [1, 1, 32, 1] uint32 per device: each device's argmax over its vocabulary share
    best: Any  # [1, 1, 32, 1] per device: each device's max (merging across devices), or None on one share
    logits: Any  # [1, 1, 32, share] row-major per device
    top: Optional[list]  # per vocabulary slice: (values, indices) [1, 1, 32, k] per device, or None
    hidden: Any  # [1, 1, 32, dim] (DRAM) when the trace keeps the final hidden states, else None


def device_tensors(outputs) -> list:
    """The device tensors in a traced program's outputs (nested lists and tuples, None where absent)."""
    if outputs is None:
        return []
    if isinstance(outputs, (list, tuple)):
        return [t for o in outputs for t in device_tensors(o)]
    return [outputs]


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

    def __init__(self, tt: TTModel, max_batch_size: int, max_seq_len: int, shares_target_cache: bool = False,
                 full_layers: Optional[int] = None):
        if not 1 <= max_batch_size <= TILE_ROWS:
            raise ValueError(f"--batch_size {max_batch_size}: a TT decode step holds at most {TILE_ROWS} users "
                             "(one 32-row tile); use 32 or fewer")
        self.tt, self.max_batch_size, self.max_seq_len = tt, max_batch_size, max_seq_len
        self.n_layers, self.vocab_size = tt.n_layers, tt.args.vocab_size
        self.full_layers = full_layers or tt.n_layers  # the whole model's layers (a draft view has fewer)
        self.max_step_rows = TILE_ROWS
        # Token trees need each row to see its ancestors only, which paged SDPA decode (each row sees every cached
        # position up to its own) does not express without an attention mask per step: chains only (README).
        self.supports_trees = False
        self.shares_target_cache = shares_target_cache
        self.device = torch.device("cpu")  # where the logits it returns live
        args = tt.args
        self.device_name = f"{args.device_name} ({' x '.join(map(str, args.cluster_shape))} mesh)"
        self.num_devices = args.num_devices
        # Each device reduces its own vocabulary share where TT leaves the LM head's output split (see module doc)
        self.split_vocab = self.num_devices > 1 and not args.is_galaxy and tt.model.sampling is not None
        self.share = args.padded_vocab_size // self.num_devices if self.split_vocab else self.vocab_size
        self.ladder = pass_ladder(TILE_ROWS)  # until warm_up plans the run's
        self.inputs: Optional[StepInputs] = None
        self.vocab_mask = None
        self.traces: dict[tuple[int, int, bool], Trace] = {}  # (write passes, top k, hidden) -> trace
        self.step_times: dict[tuple[int, int, bool], list] = defaultdict(list)  # seconds per replay, per trace

    def draft_view(self, n_layers: int) -> "TtnnCausalLM":
        """The first n_layers layers on the target's weights and cache (no copy, no catch-up), traced apart."""
        if not 1 <= n_layers < self.n_layers:
            raise ValueError(f"a draft view needs 1 to {self.n_layers - 1} layers, got {n_layers}")
        return TtnnCausalLM(self.tt.first_layers(n_layers), self.max_batch_size, self.max_seq_len,
                            shares_target_cache=True, full_layers=self.full_layers)

    def step_cost(self, n_rows: int, context_len: float) -> float:
        """A step of n_rows rows: the passes are those of one user holding every row beyond the first (an upper
        bound for several users)."""
        passes = passes_for(min(n_rows, self.ladder[-1]), self.ladder)
        return 1 + WRITE_PASS_COST * passes + KEY_COST * n_rows * context_len

    # ---- warm-up and the trace region ------------------------------------------------------------------------

    def planned_trace_bytes(self, max_rows_per_user: int, top_k: int, hidden: bool) -> list[int]:
        """The estimated size of every trace a run with these settings captures on this model (those not captured
        yet)."""
        return [self._trace_bytes(key) for key in trace_keys(max_rows_per_user, top_k, hidden) if key not in self.traces]

    def _trace_bytes(self, key: tuple[int, int, bool]) -> int:
        args = self.tt.args
        return trace_bytes(args.model_name, args.device_name, self.full_layers, self.n_layers, key, self.share)

    def warm_up(self, max_rows_per_user: int, top_k: int, hidden: bool) -> dict:
        """TT-Transformers' prefill warm-up (its first prefill_forward_text: every supported prefill length), then
        every trace the run can use compiled and captured, after checking that they fit the trace region."""
        start = time.perf_counter()
        if not self.shares_target_cache:  # a draft view never prefills: the target's prefill fills its cache
            self.prefill(0, [0])
        prefill_s = time.perf_counter() - start
        self.ladder = pass_ladder(max_rows_per_user)
        keys = [key for key in trace_keys(max_rows_per_user, top_k, hidden) if key not in self.traces]
        self.check_trace_region(max_rows_per_user, top_k, hidden)
        for passes, k, h in keys:  # writes user 0's cache, which its prefill rewrites
            self._run([UserRows(0, [0] * passes, 0)], False, k, h)
        return {"compile_prefill": prefill_s, "compile_decode": time.perf_counter() - start - prefill_s}

    def check_trace_region(self, max_rows_per_user: int, top_k: int, hidden: bool) -> None:
        """Stop before capturing with an error that names the fix when the traces would not fit the region the mesh
        was opened with (known for meshes opened through device.open_mesh: the CLI and our pytest fixture)."""
        region = TRACE_REGIONS.get(id(self.tt.mesh_device))
        if not region:
            return
        needed = TRACE_BYTES[id(self.tt.mesh_device)] + sum(self.planned_trace_bytes(max_rows_per_user, top_k, hidden))
        if needed > region:
            raise ValueError(f"the decode traces for up to {max_rows_per_user} rows per user take about "
                             f"{needed / 1e6:.0f} MB of trace region, and the mesh was opened with {region / 1e6:.0f} "
                             f"MB: open it with trace_region_size >= {region_bytes([needed])} (device_params), or "
                             "lower --n_draft_tokens")

    # ---- the CausalLM calls ----------------------------------------------------------------------------------

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

    def release(self) -> None:
        import ttnn

        for trace in self.traces.values():
            ttnn.release_trace(self.tt.mesh_device, trace.trace_id)
            TRACE_BYTES[id(self.tt.mesh_device)] -= trace.bytes
        self.traces = {}

    # ---- one traced step -------------------------------------------------------------------------------------

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
        passes = passes_for(max(len(u.tokens) for u in rows), self.ladder) if write else 1
        tokens = torch.zeros(TILE_ROWS, dtype=torch.int64)
        positions = torch.full((TILE_ROWS,), -1, dtype=torch.int64)
        page_table = self.tt.page_table[0].repeat(TILE_ROWS, 1)  # idle rows: any valid row, never read
        pass_positions = torch.full((passes, TILE_ROWS), -1, dtype=torch.int32)
        r = 0
        for user_rows in rows:
            for j, token in enumerate(user_rows.tokens):
                tokens[r], positions[r] = token, user_rows.start_pos + j
                page_table[r] = self.tt.page_table[user_rows.user]
                if write:
                    pass_positions[j, r] = positions[r]
                r += 1
        host = self.tt.model.prepare_decode_inputs_host(tokens, positions, page_table)
        host_passes = [ttnn.from_torch(p, dtype=ttnn.int32, mesh_mapper=self._replicated()) for p in pass_positions]
        self._refresh_inputs(host, host_passes)
        if (passes, top_k, hidden) not in self.traces:
            self._trace(passes, top_k, hidden)
            self._refresh_inputs(host, host_passes)  # the compile run may have advanced the positions (split vocab)
        trace = self.traces[(passes, top_k, hidden)]
        start = time.perf_counter()
        ttnn.execute_trace(self.tt.mesh_device, trace.trace_id, cq_id=0, blocking=False)
        ids = self._argmax(trace)[:r]
        self.step_times[(passes, top_k, hidden)].append(time.perf_counter() - start)
        all_logits = self._read_logits(trace) if logits else None
        top = self._top_k(trace, top_k) if top_k else None
        states = None
        if hidden:
            states = ttnn.to_torch(ttnn.get_device_tensors(trace.hidden)[0]).reshape(TILE_ROWS, -1)[:, : self.tt.args.dim]
        out_ids, out_logits, out_top, out_hidden, start = [], [], [], [], 0
        for user_rows in rows:
            end = start + len(user_rows.tokens)
            out_ids.append(ids[start:end])
            if logits:
                out_logits.append(all_logits[start:end])
            if top_k:
                out_top.append(top[start:end])
            if hidden:
                out_hidden.append(states[start:end].to(torch.bfloat16))
            start = end
        return StepOutput(out_ids, out_logits if logits else None, out_top if top_k else None,
                          out_hidden if hidden else None)

    def _per_device(self, tensor) -> list[torch.Tensor]:
        """A device tensor read back as [32, width] per device (one entry where the vocabulary is not split)."""
        import ttnn

        devices = ttnn.get_device_tensors(tensor)[: self.num_devices if self.split_vocab else 1]
        return [ttnn.to_torch(d).reshape(TILE_ROWS, -1) for d in devices]

    def _argmax(self, trace: Trace) -> list[int]:
        """Each row's greedy id: the device whose share holds the largest logit (the lowest id on ties, as argmax
        over the whole vocabulary), at its argmax."""
        ids = torch.cat(self._per_device(trace.ids), dim=1).long()  # [32, devices] local ids
        if trace.best is None:
            return ids[:, 0].tolist()
        best = torch.cat(self._per_device(trace.best), dim=1).float()
        device = best.argmax(dim=1)  # the first device on ties
        return (device * self.share + ids.gather(1, device.view(-1, 1)).view(-1)).tolist()

    def _read_logits(self, trace: Trace) -> torch.Tensor:
        return torch.cat(self._per_device(trace.logits), dim=1).float()[:, : self.vocab_size]

    def _top_k(self, trace: Trace, k: int) -> list[list[int]]:
        """The k best ids per row from every device's slices' candidates (ids read as unsigned 16 bits: topk
        returns uint16 indices for widths below 65,536, topk_device_operation.cpp resolve_index_dtype)."""
        width = vocab_slices(self.share)[0]
        values, ids = [], []
        for s, (slice_values, slice_ids) in enumerate(trace.top):
            for d, (v, i) in enumerate(zip(self._per_device(slice_values), self._per_device(slice_ids))):
                values.append(v[:, :k].float())
                ids.append((i[:, :k].long() & 0xFFFF) + d * self.share + s * width)
        values, ids = torch.cat(values, dim=1), torch.cat(ids, dim=1)
        order = torch.argsort(ids, dim=1)  # ties to the lower id, then by value (stable sort keeps that order)
        values, ids = values.gather(1, order), ids.gather(1, order)
        best = torch.argsort(values, dim=1, descending=True, stable=True)[:, :k]
        return ids.gather(1, best).tolist()

    def _replicated(self):
        """How TT-Transformers places the decode positions on the mesh (prepare_decode_inputs_host): replicated,
        or split over the mesh rows on a Galaxy."""
        import ttnn

        args = self.tt.args
        return ttnn.ShardTensor2dMesh(self.tt.mesh_device, dims=(None, 0) if args.is_galaxy else (None, None),
                                      mesh_shape=args.cluster_shape)

    def _refresh_inputs(self, host: tuple, host_passes: list) -> None:
        """First step: put the inputs on the device (TT-Transformers' copy_host_to_device), all TILE_ROWS pass
        tensors. Later steps copy into the same tensors, the pass tensors the trace reads only: nothing is
        allocated."""
        import ttnn
        from models.tt_transformers.tt.common import copy_host_to_device

        if self.inputs is None:
            unused = [ttnn.from_torch(torch.full((TILE_ROWS,), -1, dtype=torch.int32), dtype=ttnn.int32,
                                      mesh_mapper=self._replicated()) for _ in range(TILE_ROWS - len(host_passes))]
            device = copy_host_to_device([*host, *host_passes, *unused], mesh_device=self.tt.mesh_device)
            self.inputs = StepInputs(*device[:4], device[4:])
            if self.split_vocab:
                self.vocab_mask = self._device_vocab_mask()
            return
        copy_host_to_device([*host, *host_passes], [self.inputs.tokens, self.inputs.current_pos, self.inputs.rope_idxs,
                                                    self.inputs.page_table, *self.inputs.pass_positions])

    def _device_vocab_mask(self):
        """0 over the vocabulary, -inf over the LM head's padded columns, split over the devices as the logits are."""
        import ttnn

        mask = torch.zeros(1, 1, TILE_ROWS, self.tt.args.padded_vocab_size)
        mask[..., self.vocab_size :] = float("-inf")
        mapper = ttnn.ShardTensor2dMesh(self.tt.mesh_device, dims=(None, 3), mesh_shape=self.tt.args.cluster_shape)
        return ttnn.from_torch(mask, dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=self.tt.mesh_device,
                               mesh_mapper=mapper)

    def _forward(self, top_k: int, hidden: bool) -> list:
        """The traced program: the decode forward over the tile, then per device the argmax (and the max, and the
        top k of each slice) over its vocabulary share; with `hidden`, the final norm's output too."""
        import ttnn

        i, model = self.inputs, self.tt.model
        capture = HiddenCapture(model.norm) if hidden else None
        if capture:
            model.norm = capture
        try:
            out = model.ttnn_decode_forward(i.tokens, i.current_pos, rot_mat_idxs=i.rope_idxs, page_table=i.page_table,
                                            kv_cache=self.tt.kv_cache, **({"sampling_on_device": True,
                                                                           "capture_sampling_trace": True}
                                                                          if self.split_vocab else {}))
        finally:
            if capture:
                model.norm = capture.norm
        if self.split_vocab:  # each device's share, TILE, its padded columns masked
            tiles = ttnn.add(out, self.vocab_mask)
            best = ttnn.max(tiles, dim=-1, keepdim=True)
            rows = ttnn.untilize(tiles, use_multicore=True)
        else:  # TT's untilized logits, whole on every device: drop the padded columns
            rows = ttnn.slice(out[0], [0, 0, 0, 0], [1, 1, TILE_ROWS, self.vocab_size])
            tiles = ttnn.to_layout(rows, ttnn.TILE_LAYOUT) if top_k else None
            best = None
        ids = ttnn.argmax(rows, dim=-1, keepdim=True)
        top = self._slice_top_k(tiles, top_k) if top_k else None
        return [ids, best, rows, top, capture.output if capture else None]

    def _slice_top_k(self, tiles, k: int) -> list:
        import ttnn

        width, slices = vocab_slices(self.share)
        top = []
        for s in range(slices):
            end = min((s + 1) * width, self.share)
            piece = ttnn.slice(tiles, [0, 0, 0, s * width], [1, 1, TILE_ROWS, end])
            if end - s * width < width:
                piece = ttnn.pad(piece, [(0, 0), (0, 0), (0, 0), (0, width - (end - s * width))], float("-inf"))
            top.append(ttnn.topk(piece, k=k, dim=-1))
        return top

    def _trace(self, passes: int, top_k: int, hidden: bool) -> None:
        """Compile, then capture, the program for this key (its outputs are the trace's persistent tensors)."""
        import ttnn

        key, mesh = (passes, top_k, hidden), self.tt.mesh_device
        self.tt.passes.positions = self.inputs.pass_positions[:passes]
        for tensor in device_tensors(self._forward(top_k, hidden)):  # compile run: programs are built first
            ttnn.deallocate(tensor)
        trace_id = ttnn.begin_trace_capture(mesh, cq_id=0)
        outputs = self._forward(top_k, hidden)
        ttnn.end_trace_capture(mesh, trace_id, cq_id=0)
        size = self._trace_bytes(key)
        TRACE_BYTES[id(mesh)] += size
        self.traces[key] = Trace(trace_id, size, *outputs)
