# SPDX-License-Identifier: Apache-2.0
"""The `CausalLM` contract on a Tenstorrent device, over a TT-Transformers model (model.py).

- prefill: TT-Transformers' own `Generator.prefill_forward_text` for one user (padded, chunked), into the user's
  page-table row; the last token's logits come back, as TT-Transformers' own text generation does. Its first call
  runs TT's prefill warm-up sweep, which `warm_up` triggers before anything is timed.
- step: ONE traced decode forward over the 32-row tile. Row r carries one token of one user at its position with
  the user's page-table row: a verification step is every user's [last token, d1..dK] at consecutive positions,
  attention bounded per row by its own position (paged SDPA decode); unused rows and idle users sit at position
  -1, which every op skips. Cache writes go in ordered passes (attention.py). Where a program's groups fit
  (attention.group_tiles: T candidates per group, T x users <= 32), user i's rows sit at T i .. T i + T - 1 (the
  rows past its own repeat its last position and write nothing) and attention scans each user's cache once for all
  its rows (attention.GroupedRows); elsewhere the rows are packed and each row scans the cache.
- argmax on device, per device (vocab.py): only ids, and on a split vocabulary each device's max, come back; the
  logits only when sampling asks for them; the top k (token recycling) per vocabulary slice.
- taps (taps.py, for an EAGLE-3 draft head on the device): a step asked for layers `taps` also copies the residual
  stream entering each of those layers into the tap tile, a persistent tensor the head's traces read; nothing comes
  back to the host, the step returns where each user's rows sit in the tile (DeviceRows). A prefill asked for them
  reads each tapped layer's prefill input back to the host (PromptTaps): once per request, for the head's prompt rows.
- traces: one per (write passes, top k, taps) for the pass counts a run can need (trace_plan.pass_ladder), planned
  by `warm_up` and replayed, made with every other model's on the mesh (traces.MeshTraces). Every input is a
  persistent device tensor (a draft view shares its target's) refreshed with `ttnn.copy_host_to_device_tensor` (only
  the pass tensors the trace reads), so the loop allocates nothing on the device.
"""
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from ..checkpoints.eagle3_format import HeadConfig, find_draft_head
from ..checkpoints.safetensors_index import read_embedding
from ..errors import UserError
from ..speculative.backend import DeviceRows, StepOutput, UserRows
from .attention import GroupedRows, group_tiles
from .model import TILE_ROWS, TTModel, prefill_into_sink, prefill_warm_prompts, supported_kwargs, tt_prefill_warm_up
from .taps import TapCapture, gather_taps_on_host, prefill_state_to_host, prompt_taps, write_taps
from .trace_plan import TraceKey, pass_ladder, passes_for, trace_bytes, trace_keys
from .traces import MeshTraces, TracedModel, captured, device_tensors, program_cache_entries
from .tt_surface import can_keep_shares, decode_forward_kwargs, decode_logits, mesh_column_rows, padded_vocab
from .ttnn_api import ttnn
from .vocab import VocabShares

# What a step costs, in units of streaming the weights once (a decode step of the tile, which computes all 32 rows
# whatever is in them): each cache-write pass adds two paged_update_cache ops per layer, and paged SDPA decode reads
# the cached K and V once per scan, so its work grows with scans x context (model.key_cost, from the model's shapes
# and dtypes): a scan per row, or per group of rows where attention runs grouped (step_cost). Estimates (no device
# here): the hardware perf test records the step time of every traced shape
# (TtnnCausalLM.step_times) to replace them.
WRITE_PASS_COST = 0.01
# Row counts a sampled step reads its logits in: each program a sampled run traces (TraceKey.logits) also slices the
# logits' first R rows (row-major, a copy of R x share values on the device), and a step reads the smallest slice
# holding its rows; a greedy run's programs make none.
LOGIT_READS = (4, 8, 16)


@dataclass
class TracedStepInputs:
    """The persistent device tensors every traced step reads (refreshed in place before each replay)."""

    tokens: Any
    current_pos: Any
    rope_idxs: Any
    page_table: Any
    pass_positions: list  # TILE_ROWS tensors of positions, -1 outside their pass
    grouped: dict = field(default_factory=dict)  # candidates per group -> GroupedRows, for the grouped programs


@dataclass
class DeviceInputs:
    """A model's persistent device inputs, shared by a target and its draft views (each refreshes them in full
    before every replay): the step's inputs, on split-vocabulary meshes the padded-column mask, and per taps the tap
    tile a tapped step writes (a draft head's input)."""

    step: Optional[TracedStepInputs] = None
    vocab_mask: Any = None
    taps: dict = field(default_factory=dict)  # taps -> [1, 1, 32, len(taps) * dim] on every device


@dataclass
class Trace:
    trace_id: Any
    ids: Any  # [1, 1, 32, 1] uint32 per device: each device's argmax over its vocabulary share
    best: Any  # [1, 1, 32, 1] per device: each device's max (merging across devices), or None on one share
    logits: Any  # [1, 1, 32, share] row-major per device
    top: Optional[list]  # per vocabulary slice: (values, indices) [1, 1, 32, k] per device, or None
    first_rows: dict = field(default_factory=dict)  # R -> the logits' first R rows [1, 1, R, share] (LOGIT_READS)
    tap_parts: Any = None  # tap_gather "host" on a mesh: the tapped layers' copies stacked, [1, 1, 32 * taps, dim / n]


class TtnnCausalLM(TracedModel):
    """A TT-Transformers model (or a view of its first layers) behind the CausalLM contract."""

    def __init__(self, tt: TTModel, max_batch_size: int, max_seq_len: int, *, mesh_traces: MeshTraces,
                 shares_target_cache: bool = False, inputs: Optional[DeviceInputs] = None, trace: bool = True,
                 tap_gather: str = "device", grouped_attention: bool = False):
        """mesh_traces: the traces of every model on tt's mesh (one object for the mesh, shared by every model
        built on it). grouped_attention: a verify step's attention as one cache scan per user (group_tiles)."""
        if not 1 <= max_batch_size <= TILE_ROWS:
            raise UserError(f"max_batch_size {max_batch_size}: a TT decode step holds at most {TILE_ROWS} users "
                            "(one 32-row tile); use 32 or fewer", "max_batch_size")
        self.tt, self.max_batch_size, self.max_seq_len = tt, max_batch_size, max_seq_len
        self.n_layers, self.vocab_size = tt.n_layers, tt.args.vocab_size
        # The rows a step may use: the tile, or on a Galaxy one mesh column's users (tt_surface.mesh_column_rows).
        # A Galaxy column computes its own 8 rows against its own KV caches, and (in some attention.py versions) only
        # column 0's caches hold the prompts, so a user's rows must stay in column 0's rows at every step: a verify
        # row in tile rows 8-31 would attend to a cache that was never filled, or one its earlier rows never wrote.
        self.max_step_rows = mesh_column_rows(tt.model, tt.args, TILE_ROWS)
        if max_batch_size > self.max_step_rows:
            raise UserError(f"max_batch_size {max_batch_size}: on a Galaxy a decode step's rows must sit in one mesh "
                            f"column's {self.max_step_rows} users (TT-Transformers' attention gives each mesh column "
                            f"its own users and KV caches); use max_batch_size {self.max_step_rows} or fewer",
                            "max_batch_size")
        # Token trees need each row to see its ancestors only, which paged SDPA decode (each row sees every cached
        # position up to its own) does not express without an attention mask per step: chains only (README).
        self.supports_trees = False
        self.shares_target_cache = shares_target_cache
        self.device = torch.device("cpu")  # where the logits it returns live
        args = tt.args
        self.device_name = f"{args.device_name} ({' x '.join(map(str, args.cluster_shape))} mesh)"
        self.num_devices = args.num_devices
        # a row reading one cached position, in step costs (step_cost); a server's model gets its cache, and this,
        # at warm-up (serving/ttnn_model.py PagedVerify.warm)
        self.key_cost = tt.key_cost() if tt.kv_cache is not None else None
        # each device reduces its own vocabulary share where TT leaves the LM head's output split (vocab.py)
        split = (self.num_devices > 1 and not args.is_galaxy and tt.model.sampling is not None
                 and can_keep_shares(tt.model))
        self.vocab = VocabShares(tt.mesh_device, args.cluster_shape, self.vocab_size,
                                 padded_vocab(args) // self.num_devices if split else self.vocab_size, split,
                                 self.num_devices)
        self.ladder = pass_ladder(TILE_ROWS)  # until warm_up plans the run's
        self.planned: set[TraceKey] = set()  # (write passes, top k, taps) of every program a run uses
        self.kept: set[TraceKey] = set()  # programs planned through every later run's plan (keep_planned)
        self.compiled: set[TraceKey] = set()  # the planned programs already run once (kernels built)
        self.prefilled = False  # TT's prefill warm-up (its first prefill_forward_text) has run
        self.prefill_warmed = False  # _warm_up_prefill has run (its programs stay in the mesh's program cache)
        # False: every step runs its ops eagerly (TT's enable_trace=False): a failure names the op, not a trace
        self.trace = trace
        # where a mesh's tapped states are gathered (taps.write_taps): "device", one all-gather inside each tapped
        # trace, or "host", read back and written to the tap tile after each replay (no collective of ours in a trace)
        self.tap_gather = tap_gather
        self.grouped_attention = grouped_attention
        self.inputs = inputs if inputs is not None else DeviceInputs()
        self.traces: dict[TraceKey, Trace] = {}
        self.step_times: dict[TraceKey, list] = defaultdict(list)  # seconds per replay, per trace
        self.mesh_traces = mesh_traces
        mesh_traces.add(self)

    def draft_view(self, n_layers: int) -> "TtnnCausalLM":
        """The first n_layers layers on the target's weights, cache and device inputs (no copy, no catch-up), traced
        apart."""
        if not 1 <= n_layers < self.n_layers:
            raise ValueError(f"a draft view needs 1 to {self.n_layers - 1} layers, got {n_layers}")
        return TtnnCausalLM(self.tt.first_layers(n_layers), self.max_batch_size, self.max_seq_len,
                            mesh_traces=self.mesh_traces, shares_target_cache=True, inputs=self.inputs,
                            trace=self.trace, tap_gather=self.tap_gather,
                            grouped_attention=self.grouped_attention)

    def draft_head(self, draft_head, chain_len: int, required: bool) -> dict:
        """The EAGLE-3 head make_drafter drafts with, on the device beside this model (CausalLM.draft_head)."""
        checkpoint = self.tt.checkpoint
        head = find_draft_head(draft_head, checkpoint.name if checkpoint else None, self.tt.config, self.n_layers,
                               False, required)
        return {} if head is None else {"device_head": self.build_head(*head, chain_len)}

    def build_head(self, config: HeadConfig, weights: dict, chain_len: int):
        """A read head (eagle3_format.read_draft_head) on the device as a TtnnDraftHead in this model's weights dtype,
        drafting traced chains of chain_len tokens from the taps this model's steps leave there (make_drafter's
        `device_head`); the tokens it is fed are looked up on the host in the head's embedding, else the
        checkpoint's."""
        from .eagle3_head import TtnnDraftHead  # it builds on this module

        embedding = weights.get("embed_tokens.weight")
        if embedding is None and self.tt.checkpoint is None:
            raise UserError("draft_head: the head ships no embedding and this model knows no checkpoint to read the "
                            "target's from (TTModel.checkpoint, which build_tt_model sets); set it, or give a head "
                            "with embed_tokens.weight", "draft_head")
        embedding = read_embedding(self.tt.checkpoint) if embedding is None else embedding
        return TtnnDraftHead(self, config, weights, embedding, chain_len, self.tt.config,
                             weights_dtype=getattr(ttnn, self.tt.weights_dtype))

    def step_cost(self, n_users: int, n_rows: int, context_len: float) -> float:
        """A step of n_rows rows: the passes are those of one user holding every row beyond the first (an upper
        bound for several users), and so are the cache scans: one per row, or one per group of rows where the
        program runs attention grouped (group_tiles)."""
        passes = passes_for(min(n_rows, self.ladder[-1]), self.ladder)
        scans = n_users - 1 + -(-(n_rows - n_users + 1) // self.group_tiles(passes))
        return 1 + WRITE_PASS_COST * passes + self.key_cost * scans * context_len

    def group_tiles(self, passes: int) -> int:
        """Candidates per attention group in the program of `passes` write passes (attention.group_tiles), 1: per
        row, as a plain step. Per row unless grouped_attention: a grouped scan splits its reduction over the cores
        otherwise than the per-row op a plain step runs, and tt-metal's own test of the mode finds the two bit-equal
        only when the splits match, so verify rows are not shown bit-identical to plain decoding on silicon (lossless
        is the contract; docs/ttnn_backend.md). A Galaxy keeps per row: each mesh column computes its own 8 users
        (max_step_rows)."""
        if not self.grouped_attention or self.tt.args.is_galaxy:
            return 1
        return group_tiles(passes, self.max_batch_size, self._local_kv_heads())

    # ---- warm-up, traces and the trace region ----------------------------------------------------------------

    def warm_up(self, max_rows_per_user: int, top_k: int, taps: Sequence[int], logits: bool = False) -> dict:
        """TT-Transformers' prefill warm-up (its first prefill_forward_text: every supported prefill length), then
        the programs a run with these settings uses (logits: a sampled run's, whose steps read the logits) planned and
        checked against the trace region. They are compiled and captured, with every other model's on the mesh, by
        `prepare_traces` (or the first step that needs them): planning every model first captures each trace once."""
        taps = self._check_taps(taps)
        start = time.perf_counter()
        if not self.shares_target_cache:  # a draft view never prefills: the target's prefill fills its cache
            self._warm_up_prefill()
        self.ladder = pass_ladder(max_rows_per_user)
        # a run's plan replaces an earlier run's (their traces are released when the mesh's are next made): runs in
        # sequence on one model never hold more traces than the most demanding of them, and what keep_planned keeps
        self.planned = set(trace_keys(max_rows_per_user, top_k, taps, logits)) | self.kept
        self.mesh_traces.check_region()
        return {"compile_prefill": time.perf_counter() - start, "compile_decode": 0.0}

    def keep_planned(self, max_rows_per_user: int, top_k: int, taps: Sequence[int], logits: bool = False) -> None:
        """Keep the programs of a run with these settings planned through every later warm-up, whatever that run plans:
        a session that knows each shape it will step (make tt-smoke) captures every trace once, where otherwise each
        run whose plan differs releases and captures the mesh's traces again. Their traces stay live beside every
        run's: the trace region must hold them all."""
        self.kept |= set(trace_keys(max_rows_per_user, top_k, self._check_taps(taps), logits))

    def _warm_up_prefill(self) -> None:
        """TT's prefill warm-up (its first prefill_forward_text sweeps the lengths of
        ModelArgs.get_warmup_prefill_supported_seq_lens, up to capped_warmup_seq_len), then one prefill of every prompt
        length model.prefill_warm_prompts names: every padded length TT's sweep leaves out (256 and 512, the chunked
        lengths past the chunk size, ...), and every last-token tile of the prompts up to PER_TILE_WARM_POSITIONS
        tokens (TT's last-token ttnn.slice and its paged_fill_cache compile per tile and page-table width). So those
        programs are built before any decode trace is live: compiled under one, their kernel binaries may be
        overwritten when it replays (allocator.cpp verify_safe_allocation); a prefill that still compiles something
        later has the traces made again (MeshTraces.remake_after). Paged into the sink block through a page-table row as
        wide as a user's (model.prefill_into_sink), as TT's own warm-up pages its prompts (a page table of zeros)."""
        if self.prefill_warmed:  # a later run on the same model: its programs are in the program cache
            return
        programs = program_cache_entries(self.tt.mesh_device)
        self.prefill(0, [0])
        prefill_into_sink(self.tt.generator, [self.tt.kv_cache], self.tt.page_table.shape[1],
                          prefill_warm_prompts(self.tt.args, self.max_seq_len))
        self.prefill_warmed = True
        # another model's traces may already be live on the mesh (a pool's earlier run): made again if so
        self.mesh_traces.remake_after(programs, "the prefill warm-up")

    def prepare_traces(self) -> float:
        """Compile, and capture where tracing, every program planned on this mesh (MeshTraces.prepare); seconds
        spent."""
        start = time.perf_counter()
        self.mesh_traces.prepare()
        return time.perf_counter() - start

    def trace_bytes(self, key: TraceKey) -> int:
        args = self.tt.args
        return trace_bytes(args.model_name, args.device_name, self.tt.full_layers, self.n_layers, key,
                           self.vocab.share)

    def compile(self, key: TraceKey) -> None:
        """The program for this key run once, outside any trace, so its kernels are built (and, on a first call, the
        persistent inputs allocated) before anything is captured. Every write pass is -1 first: the run writes
        nothing to the cache (it may come in the middle of a generation)."""
        self._run_inputs([UserRows(0, [0], 0)], write=False, passes=TILE_ROWS)
        self._bind(key.passes)
        # a scratch tile: the tap tile may hold a verified step's states the head has not been fed yet
        scratch = ttnn.clone(self.tap_tile(key.taps), memory_config=ttnn.DRAM_MEMORY_CONFIG) if key.taps else None
        self.tt.passes.count_from_zero()
        outputs = self._forward(key, scratch)
        self._check_ordered_writes(key.passes)
        for tensor in device_tensors(outputs) + ([scratch] if key.taps else []):
            ttnn.deallocate(tensor)

    def _check_ordered_writes(self, passes: int) -> None:
        """Every layer's K and V cache writes went through the ordered writer (attention.py), each as `passes` update
        ops: otherwise TT-Transformers reached paged_update_cache some other way (bound at import, fused, a renamed
        forward_decode) and a verify step's rows would race in one op, losing writes with no error. One line naming
        the counts."""
        done = self.tt.passes
        if done.writes != 2 * self.n_layers or done.issued != 2 * self.n_layers * passes:
            raise RuntimeError(f"the ordered cache writes did not reach TT-Transformers' attention: a {self.n_layers}-"
                               f"layer decode step made {done.writes} K/V writes through them ({2 * self.n_layers} "
                               f"expected) and issued {done.issued} update ops ({2 * self.n_layers * passes} expected "
                               f"for {passes} passes); this tt-metal's tt/attention.py does not call "
                               "ttnn.experimental.paged_update_cache from Attention.forward_decode (tt_surface probe)")

    def capture(self, key: TraceKey) -> None:
        """The program for this key captured as a trace (its outputs are the trace's persistent tensors)."""
        self._bind(key.passes)
        trace_id, outputs = captured(self.tt.mesh_device,
                                     lambda: self._forward(key, self.tap_tile(key.taps) if key.taps else None))
        self.traces[key] = Trace(trace_id, *outputs)

    # ---- the CausalLM calls ----------------------------------------------------------------------------------

    def prefill(self, user: int, tokens: Sequence[int], logits: bool = False, taps: Sequence[int] = ()
                ) -> StepOutput:
        taps = self._check_taps(taps)
        generator = self.tt.generator
        if taps and not self.prefilled:  # TT's first prefill runs its warm-up sweep: not under the taps' host reads
            self.prefill(user, list(tokens[:1]))
        if not self.prefilled:  # TT's warm-up without its sampling sweep, before its first prefill runs it with it
            tt_prefill_warm_up(generator, [self.tt.kv_cache])
        self.prefilled = True
        programs = program_cache_entries(self.tt.mesh_device)
        mesh, dim = self.tt.mesh_device, self.tt.args.dim
        with TapCapture(self.tt.model.layers, taps, copy=lambda x: prefill_state_to_host(x, mesh, self.num_devices, dim)
                        ) as capture:
            out = generator.prefill_forward_text(torch.tensor([list(tokens)]), **supported_kwargs(
                generator.prefill_forward_text, page_table=self.tt.page_table[user : user + 1],
                kv_cache=[self.tt.kv_cache], prompt_lens=[len(tokens)], empty_slots=[user], enable_trace=False))
        self.mesh_traces.remake_after(programs, f"a prefill of {len(tokens)} tokens")
        row = decode_logits(out).reshape(-1)[: self.vocab_size].float().view(1, -1)
        states = [prompt_taps(capture.outputs, taps, len(tokens))] if taps else None
        return StepOutput([row.argmax(dim=-1).tolist()], [row] if logits else None, hidden=states)

    def tt_greedy(self, user: int, tokens: Sequence[int], n: int) -> list[int]:
        """n greedy ids after `tokens` by TT-Transformers' own path, a reference for this backend's steps: this
        prefill (TT's prefill_forward_text), then TT's Generator.decode_forward untraced with host sampling
        (enable_trace False, sampling_params None: tt/generator.py@622c6fb9 _decode_forward_no_trace_text, its
        logits gathered and read back, argmax here) for the user's row in row 0, the other rows idle (token 0,
        position -1, as _run_inputs) and TT's single cache update (no write passes). TT's eager decode compiles its
        own programs: live traces are made again after it (remake_after), so call it before capturing."""
        first = self.prefill(user, tokens).ids[0][0]
        generator, ids = self.tt.generator, [first]
        self.tt.passes.positions = []
        programs = program_cache_entries(self.tt.mesh_device)
        token, positions = torch.zeros(TILE_ROWS, 1, dtype=torch.int64), torch.full((TILE_ROWS,), -1)
        page_table = self.tt.page_table[user].repeat(TILE_ROWS, 1)
        for j in range(n - 1):
            token[0, 0], positions[0] = ids[-1], len(tokens) + j
            out = generator.decode_forward(token, positions, **supported_kwargs(
                generator.decode_forward, page_table=page_table, kv_cache=[self.tt.kv_cache], enable_trace=False,
                read_from_device=True, sampling_params=None))
            logits = torch.as_tensor(decode_logits(out)).reshape(TILE_ROWS, -1)[0, : self.vocab_size]
            ids.append(int(logits.float().argmax()))
        self.mesh_traces.remake_after(programs, "TT's reference decode")
        return ids

    def commit_path(self, user: int, start_pos: int, path: Sequence[int]) -> None:
        raise NotImplementedError("the ttnn backend verifies chains only (supports_trees is False)")

    def step(self, rows: Sequence[UserRows], logits: bool = False, top_k: int = 0, taps: Sequence[int] = (),
             page_table: Optional[torch.Tensor] = None) -> StepOutput:
        """page_table: this step's [users, blocks] int32 page table (user u's blocks: row u), staged into the
        persistent page-table input like every other input; None: the model's own (TTModel.page_table). A server
        passes its scheduler's table, which changes every step (serving/ttnn_model.py)."""
        if any(r.parents is not None for r in rows):
            raise ValueError("the ttnn backend verifies chains only (supports_trees is False)")
        return self._run(rows, logits, top_k, self._check_taps(taps), page_table)

    def tap_tile(self, taps: tuple[int, ...]):
        """The persistent tap tile for these taps [1, 1, 32, len(taps) * dim], bfloat16 on every device: allocated by
        the first program that compiles with it (MeshTraces.prepare: never while a trace is live)."""
        if taps not in self.inputs.taps:
            self.inputs.taps[taps] = ttnn.from_torch(
                torch.zeros(1, 1, TILE_ROWS, len(taps) * self.tt.args.dim), dtype=ttnn.bfloat16,
                layout=ttnn.TILE_LAYOUT, device=self.tt.mesh_device, memory_config=ttnn.DRAM_MEMORY_CONFIG,
                mesh_mapper=ttnn.ReplicateTensorToMesh(self.tt.mesh_device))
        return self.inputs.taps[taps]

    def read_taps(self, taps: Sequence[int]) -> torch.Tensor:
        """The tap tile the last step with these taps wrote, [32, len(taps) * dim] (what a device head reads; for
        checks: the loop never reads it)."""
        tile = self.tap_tile(tuple(taps))
        return ttnn.to_torch(ttnn.get_device_tensors(tile)[0]).reshape(TILE_ROWS, -1).float()

    def _check_taps(self, taps: Sequence[int]) -> tuple[int, ...]:
        """taps as a trace key; layer ids out of range, or any on a Galaxy, refused with one line."""
        taps = tuple(taps)
        if any(not 0 <= i < self.n_layers for i in taps):
            raise ValueError(f"taps {list(taps)}: layer ids must be in [0, {self.n_layers})")
        if taps and self.tt.args.is_galaxy:
            raise ValueError("taps on a Galaxy: its decode residual is split over the mesh columns and replicated "
                             "over its rows, which this backend does not gather; use a draft mode without a draft "
                             "head there")
        return taps

    # ---- one traced step -------------------------------------------------------------------------------------

    def _run(self, rows: Sequence[UserRows], logits: bool, top_k: int, taps: tuple[int, ...],
             page_table: Optional[torch.Tensor] = None) -> StepOutput:
        """One replay of the decode trace over `rows`. A shape no warm-up planned is planned now and the mesh's traces
        made again (MeshTraces.prepare). taps: checked (_check_taps)."""
        self._check_rows(sum(len(r.tokens) for r in rows))  # before anything is planned or compiled for the step
        passes = passes_for(max(len(u.tokens) for u in rows), self.ladder)
        key = TraceKey(passes, top_k, taps, logits)
        if key not in (self.traces if self.trace else self.compiled):
            self.planned.add(key)
            self.mesh_traces.check_region()
            self.mesh_traces.prepare()
        r = self._run_inputs(rows, True, passes, page_table)
        start = time.perf_counter()
        if self.trace:
            trace = self.traces[key]
            ttnn.execute_trace(self.tt.mesh_device, trace.trace_id, cq_id=0, blocking=False)
        else:  # eager: the same program, op by op
            self._bind(passes)
            trace = Trace(None, *self._forward(key, self.tap_tile(taps) if taps else None))
        # every output is read right after its own trace's replay: a later trace's capture allocated under this one
        # (MeshTraces.prepare) may overwrite its outputs when that trace replays, never before they are read here
        ids = self.vocab.greedy(trace.ids, trace.best, r)
        all_logits = self.vocab.logits(trace.logits, trace.first_rows, r) if logits else None
        top = self.vocab.top_k(trace.top, top_k) if top_k else None
        if trace.tap_parts is not None:
            gather_taps_on_host(self.tt.mesh_device, trace.tap_parts, taps, self.tap_tile(taps))
        self.step_times[key].append(time.perf_counter() - start)  # the step as the loop sees it: reads included
        if not self.trace:
            for tensor in device_tensors([trace.ids, trace.best, trace.logits, trace.top, trace.first_rows,
                                          trace.tap_parts]):
                ttnn.deallocate(tensor)
        out_ids, out_logits, out_top, out_hidden = [], [], [], []
        for start, user_rows in zip(self._first_rows(rows, self.group_tiles(passes)), rows):
            end = start + len(user_rows.tokens)
            out_ids.append(ids[start:end])
            if logits:
                out_logits.append(all_logits[start:end])
            if top_k:
                out_top.append(top[start:end])
            if taps:  # the user's tapped states stay in the tap tile, rows start..end - 1
                out_hidden.append(DeviceRows(start, user_rows.start_pos))
        return StepOutput(out_ids, out_logits if logits else None, out_top if top_k else None,
                          out_hidden if taps else None)

    def _run_inputs(self, rows: Sequence[UserRows], write: bool, passes: int,
                    table: Optional[torch.Tensor] = None) -> int:
        """The step's inputs on the device (the first call allocates them, with every pass tensor; later calls copy
        into them, the pass tensors the trace reads only, and the groups' inputs of a grouped program); the number of
        rows to read back (through the last user's last row)."""
        from models.tt_transformers.tt.common import copy_host_to_device

        self._check_rows(sum(len(r.tokens) for r in rows))
        tiles = self.group_tiles(passes)
        tokens = torch.zeros(TILE_ROWS, dtype=torch.int64)
        positions = torch.full((TILE_ROWS,), -1, dtype=torch.int64)
        table = self.tt.page_table if table is None else table  # user u's blocks: row u
        page_table = table[0].repeat(TILE_ROWS, 1)  # idle rows: any valid row, never read
        pass_positions = torch.full((passes, TILE_ROWS), -1, dtype=torch.int32)
        end = 0
        for first, user_rows in zip(self._first_rows(rows, tiles), rows):
            n = len(user_rows.tokens)
            for j in range(n if tiles == 1 else tiles):  # a group's rows past the user's repeat its last position
                r = first + j
                tokens[r], positions[r] = user_rows.tokens[min(j, n - 1)], user_rows.start_pos + min(j, n - 1)
                page_table[r] = table[user_rows.user]
                if write and j < n:
                    pass_positions[j, r] = positions[r]
            end = first + n
        decode_inputs = self.tt.model.prepare_decode_inputs_host(tokens, positions, page_table)
        if len(decode_inputs) != 4:
            raise ValueError(f"TT-Transformers' prepare_decode_inputs_host returned {len(decode_inputs)} inputs where "
                             "the backend takes 4 (tokens, current_pos, rot_mat_idxs, page_table): this tt-metal's "
                             "decode interface is not one the backend drives (tt_surface probe)")
        host = [*decode_inputs,
                *(ttnn.from_torch(p, dtype=ttnn.int32, mesh_mapper=self._replicated()) for p in pass_positions)]
        if self.inputs.step is None:
            device = copy_host_to_device(host, mesh_device=self.tt.mesh_device)
            self.inputs.step = TracedStepInputs(*device[:4], device[4:])
            if self.vocab.split:
                self.inputs.vocab_mask = self.vocab.device_mask()
        else:
            i = self.inputs.step
            copy_host_to_device(host, [i.tokens, i.current_pos, i.rope_idxs, i.page_table, *i.pass_positions])
        if tiles > 1:
            self._write_groups(tiles, positions, table, [u.user for u in rows])
        return end

    @staticmethod
    def _first_rows(rows: Sequence[UserRows], tiles: int) -> list[int]:
        """Each user's first row in the tile: packed, or at tiles x its slot when attention runs grouped."""
        if tiles == 1:
            return [sum(len(u.tokens) for u in rows[:i]) for i in range(len(rows))]
        if len(rows) * tiles > TILE_ROWS or any(len(u.tokens) > tiles for u in rows):
            raise ValueError(f"a step of {len(rows)} users of up to {max(len(u.tokens) for u in rows)} rows does not "
                             f"fit groups of {tiles} rows in the {TILE_ROWS}-row tile")
        return [i * tiles for i in range(len(rows))]

    def _grouped_rows(self, tiles: int) -> GroupedRows:
        """The groups' device inputs for `tiles` candidates per group (allocated on first use, with every group at
        -1: no cache is read): GroupedRows."""
        step, shapes = self.inputs.step, self.tt.config
        if tiles not in step.grouped:
            kv_heads, heads = self._local_kv_heads(), shapes.n_heads // self.num_devices
            shape = (1, TILE_ROWS // tiles, tiles * TILE_ROWS, shapes.head_dim)
            head = torch.arange(tiles * TILE_ROWS).view(1, 1, -1, 1) % TILE_ROWS  # a row's Q head in its row tile
            masks = [((head >= h * heads // kv_heads) & (head < (h + 1) * heads // kv_heads)).expand(shape).float()
                     for h in range(kv_heads)] if kv_heads > 1 else []
            table, positions = self._group_host(tiles, torch.full((TILE_ROWS,), -1), self.tt.page_table, [])
            step.grouped[tiles] = GroupedRows(tiles, *self._on_device([table, positions]), [
                ttnn.from_torch(m, dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=self.tt.mesh_device,
                                memory_config=ttnn.DRAM_MEMORY_CONFIG,
                                mesh_mapper=ttnn.ReplicateTensorToMesh(self.tt.mesh_device)) for m in masks])
        return step.grouped[tiles]

    def _group_host(self, tiles: int, positions: torch.Tensor, table: torch.Tensor, users: list) -> tuple:
        """The groups' page table and positions on the host (GroupedRows): slot g holds user users[g] (its blocks:
        row users[g] of `table`), the slots past them row 0 (their positions are -1: never read)."""
        kv_heads, groups = self._local_kv_heads(), TILE_ROWS // tiles
        rows = table[users + [0] * (groups - len(users))].to(torch.int32)
        table = torch.cat([rows * kv_heads + h for h in range(kv_heads)])  # block b of head h: b x heads + h
        return (ttnn.from_torch(table, dtype=ttnn.int32, mesh_mapper=self._replicated()),
                ttnn.from_torch(positions.to(torch.int32).repeat(kv_heads), dtype=ttnn.int32,
                                mesh_mapper=self._replicated()))

    def _local_kv_heads(self) -> int:
        """The KV heads each device's cache holds (TT's n_local_kv_heads off a Galaxy)."""
        return self.tt.config.n_kv_heads // self.num_devices

    def _write_groups(self, tiles: int, positions: torch.Tensor, table: torch.Tensor, users: list) -> None:
        from models.tt_transformers.tt.common import copy_host_to_device

        grouped = self._grouped_rows(tiles)
        copy_host_to_device(list(self._group_host(tiles, positions, table, users)),
                            [grouped.page_table, grouped.positions])

    def _on_device(self, host: list) -> list:
        from models.tt_transformers.tt.common import copy_host_to_device

        return copy_host_to_device(host, mesh_device=self.tt.mesh_device)

    def _bind(self, passes: int) -> None:
        """The program of `passes` write passes: its pass positions, and its groups where attention runs grouped."""
        tiles = self.group_tiles(passes)
        self.tt.passes.positions = self.inputs.step.pass_positions[:passes]
        self.tt.passes.grouped = self._grouped_rows(tiles) if tiles > 1 else None

    def _check_rows(self, n_rows: int) -> int:
        """n_rows, or one line when a step of that many rows does not fit (max_step_rows)."""
        if n_rows > self.max_step_rows:
            where = "the decode tile" if self.max_step_rows == TILE_ROWS else "one Galaxy mesh column's rows"
            raise ValueError(f"a step of {n_rows} rows does not fit {where} ({self.max_step_rows})")
        return n_rows

    def _replicated(self):
        """How TT-Transformers places the decode positions on the mesh (prepare_decode_inputs_host): replicated,
        or split over the mesh rows on a Galaxy."""
        args = self.tt.args
        return ttnn.ShardTensor2dMesh(self.tt.mesh_device, dims=(None, 0) if args.is_galaxy else (None, None),
                                      mesh_shape=args.cluster_shape)

    def _forward(self, key: TraceKey, tile=None) -> list:
        """The traced program: the decode forward over the tile, then per device the argmax (and the max, and the
        top k of each slice) over its vocabulary share (VocabShares.reduce); with key.taps, the tapped states written
        to `tile` (taps.write_taps); with key.logits (a sampled run), the logits' first rows sliced for its reads (a
        greedy trace reads ids only). Outputs go to DRAM (a trace keeps them: L1 is for the ops)."""
        i, model, dram = self.inputs.step, self.tt.model, ttnn.DRAM_MEMORY_CONFIG
        with TapCapture(model.layers, key.taps) as capture:
            out = decode_logits(model.ttnn_decode_forward(
                i.tokens, i.current_pos, rot_mat_idxs=i.rope_idxs, page_table=i.page_table, kv_cache=self.tt.kv_cache,
                **decode_forward_kwargs(model, self.vocab.split)))
        ids, best, rows, top = self.vocab.reduce(out, self.inputs.vocab_mask, key.top_k)
        tap_parts = write_taps(model, self.tt.args.dim, self.num_devices, self.tap_gather, capture.outputs, key.taps,
                               tile) if key.taps else None
        first_rows = {r: ttnn.slice(rows, [0, 0, 0, 0], [1, 1, r, rows.shape[-1]], memory_config=dram)
                      for r in (LOGIT_READS if key.logits else ())}
        return [ids, best, rows, top, first_rows, tap_parts]
