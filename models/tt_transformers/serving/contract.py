# SPDX-License-Identifier: Apache-2.0
"""vllm-tt-plugin's speculative-decoding contract, written here from its specification so that the package can meet
it, and be tested, where the plugin cannot be installed: the values that cross between the plugin's runner and a
model, the checks the runner and the model make on them, and the runner's greedy accept walk.

Pinned (tenstorrent/vllm-tt-plugin, PR branches of issue #110; the branches differ, see docs/serving.md): the
specification `docs/SPEC_DECODE_CONTRACT.md` at CONTRACT_DOC_COMMIT, the value types `src/vllm_tt_plugin/spec_decode.py`
at CONTRACT_TYPES_COMMIT and the runner `src/vllm_tt_plugin/model_runner.py` at RUNNER_COMMIT. They differ on one call:
on a decode step where no row carries a draft, a model declaring supports_narrow_decode gets from that runner
(_prepare_model_inputs) a one-column verify, [B, 1] tokens and [B] positions with spec_mode and both side tensors,
whose argmax_ids [B, 1] its accept walk reads (spec_decode.py's accept_greedy_drafts has the case); the document
(section 4, "The two call shapes") sends the same step as the ordinary decode, without spec_mode or side tensors. A
model here serves both (check_verify_block, check_plain_decode): the runner pinned sends the first, a runner written
to the document the second. `SpecPlan.k_by_rows` comes from a later branch version; it is optional and this package's
plans leave it empty.

Where the plugin is installed its runner checks `isinstance` against its own classes, so a model hands it
`to_plugin(value)`; these classes are what the package uses everywhere else.
"""
from dataclasses import dataclass, fields
from typing import Any, Optional, Sequence

import torch

CONTRACT_DOC_COMMIT = "00d62588904fe6b0a7c6763b97ffe6a3b4e850c5"
CONTRACT_TYPES_COMMIT = "02f45e5f087fdccd1bb4fb63547dab340cef7ee8"
RUNNER_COMMIT = "02f45e5f087fdccd1bb4fb63547dab340cef7ee8"

# The sentinel `model` of a `custom_class` speculative config: the model's own propose_draft_tokens drafts (nothing is
# imported from this path).
MODEL_OWNED_DRAFTER = "vllm_tt_plugin.model_owned_drafter"

# What a verify returns: logits [B, 1+K, V], argmax ids [B, 1+K] (greedy; the only mode the runner executes), or
# accepted ids and counts sampled on the device.
ACCEPT_MODE_LOGITS = "logits"
ACCEPT_MODE_ARGMAX_IDS = "argmax_ids"
ACCEPT_MODE_FUSED_SAMPLE = "fused_sample"
ACCEPT_MODES = frozenset({ACCEPT_MODE_LOGITS, ACCEPT_MODE_ARGMAX_IDS, ACCEPT_MODE_FUSED_SAMPLE})
MODE_REQUIRED_FIELDS = {ACCEPT_MODE_LOGITS: ("logits",), ACCEPT_MODE_ARGMAX_IDS: ("argmax_ids",),
                        ACCEPT_MODE_FUSED_SAMPLE: ("accepted_token_ids", "accepted_counts")}

# Where a drafter's own state lives: allocated by the model, a scheduler-owned paged cache, or the target's caches.
DRAFTER_STATE_INTERNAL = "internal"
DRAFTER_STATE_PAGED = "paged"
DRAFTER_STATE_SHARED_WITH_TARGET = "shared_with_target"
DRAFTER_STATES = frozenset({DRAFTER_STATE_INTERNAL, DRAFTER_STATE_PAGED, DRAFTER_STATE_SHARED_WITH_TARGET})
DRAFTER_TARGET_CACHE_REQUIREMENTS = frozenset({"named_layer_caches", "absolute_positions"})

# What a drafter can serve (model_capabilities["spec_requirements"]) and how the target's hidden state reaches it.
SPEC_REQUIREMENT_DEVICE_PROPOSE = "device_propose"
SPEC_REQUIREMENTS = frozenset({SPEC_REQUIREMENT_DEVICE_PROPOSE, "hidden_feed", "drafter_scores", "paged_drafter_cache"})
HIDDEN_HANDOFFS = frozenset({"on_device", "roundtrip"})

# A column that holds no token (a padded draft column, a committed block's tail). Never a real id, EOS included.
PLACEHOLDER_TOKEN_ID = -1


def declared_values(values: Optional[Sequence[str]], known: frozenset, label: str) -> tuple[str, ...]:
    """A declared list of names as a tuple: absent is empty; a single string, an unknown name or a repeat is refused
    (a typo would otherwise switch off what it names)."""
    if values is None:
        return ()
    if isinstance(values, str):
        raise ValueError(f"{label} must be a list of names, not the string {values!r}")
    declared = tuple(values)
    unknown = [v for v in declared if v not in known]
    if unknown:
        raise ValueError(f"{label}: unknown {unknown}; known: {sorted(known)}")
    if len(set(declared)) != len(declared):
        raise ValueError(f"{label} names a value twice: {list(declared)}")
    return declared


@dataclass(frozen=True)
class SpecPlan:
    """What a model serves at one (max_num_seqs, requested K) point, returned by its `spec_plan` at configuration.

    effective_k: the draft length served (<= the requested one); lanes_per_request: decode rows one speculating
    request occupies in a verify; extra_bytes_per_seq / extra_bytes_per_token: device bytes a speculating request
    costs, fixed and per KV token; accept_modes: what a verify can return; drafter_state: where the drafter's state
    lives; drafter_target_cache_requires: what a drafter sharing the target's caches needs of them;
    supports_narrow_decode: the model also serves its ordinary [B, 1] decode on steps with nothing to verify;
    k_by_rows: optional ((max_rows, k), ...) caps of the draft length by live rows, ascending.
    """

    effective_k: int
    lanes_per_request: int
    extra_bytes_per_seq: int
    extra_bytes_per_token: int
    accept_modes: tuple[str, ...]
    drafter_state: str
    drafter_target_cache_requires: tuple[str, ...] = ()
    supports_narrow_decode: bool = False
    k_by_rows: tuple[tuple[int, int], ...] = ()

    def __post_init__(self):
        if self.effective_k < 1:
            raise ValueError(f"SpecPlan.effective_k must be >= 1 (a model that cannot speculate returns SpecReject), "
                             f"got {self.effective_k}")
        if self.lanes_per_request < 1:
            raise ValueError(f"SpecPlan.lanes_per_request must be >= 1, got {self.lanes_per_request}")
        for name in ("extra_bytes_per_seq", "extra_bytes_per_token"):
            if getattr(self, name) < 0:
                raise ValueError(f"SpecPlan.{name} must be >= 0, got {getattr(self, name)}")
        modes = declared_values(self.accept_modes, ACCEPT_MODES, "SpecPlan.accept_modes")
        if not modes:
            raise ValueError("SpecPlan.accept_modes must name at least one accept mode")
        object.__setattr__(self, "accept_modes", modes)
        if self.drafter_state not in DRAFTER_STATES:
            raise ValueError(f"SpecPlan.drafter_state {self.drafter_state!r} is not one of {sorted(DRAFTER_STATES)}")
        requires = declared_values(self.drafter_target_cache_requires, DRAFTER_TARGET_CACHE_REQUIREMENTS,
                                   "SpecPlan.drafter_target_cache_requires")
        if requires and self.drafter_state != DRAFTER_STATE_SHARED_WITH_TARGET:
            raise ValueError(f"SpecPlan.drafter_target_cache_requires {list(requires)} applies only to drafter_state "
                             f"{DRAFTER_STATE_SHARED_WITH_TARGET!r}, not {self.drafter_state!r}")
        object.__setattr__(self, "drafter_target_cache_requires", requires)
        caps = tuple((int(rows), int(k)) for rows, k in self.k_by_rows)
        if any(b[0] <= a[0] for a, b in zip(caps, caps[1:])) or any(not 1 <= k <= self.effective_k or rows < 1
                                                                     for rows, k in caps):
            raise ValueError(f"SpecPlan.k_by_rows {list(caps)}: (max_rows, k) pairs with max_rows >= 1 strictly "
                             f"ascending and 1 <= k <= effective_k ({self.effective_k})")
        object.__setattr__(self, "k_by_rows", caps)

    @property
    def accepted_counts_range(self) -> tuple[int, int]:
        """Inclusive range of an accepted count: tokens a step committed (1 after a prefill or a plain step)."""
        return 1, 1 + self.effective_k

    @property
    def block_width(self) -> int:
        """Columns of a verify's block: the last committed token and K drafts."""
        return 1 + self.effective_k

    def draft_cap(self, live_rows: int) -> int:
        """The draft length served with `live_rows` requests decoding (effective_k without k_by_rows)."""
        for max_rows, k in self.k_by_rows:
            if live_rows <= max_rows:
                return k
        return self.effective_k if not self.k_by_rows else 0


@dataclass(frozen=True)
class SpecReject:
    """Why a model cannot serve a (max_num_seqs, requested K) point, and the K it could serve at that concurrency
    (quoted to the operator; empty when none)."""

    reason: str
    supported_k: tuple[int, ...] = ()

    def __post_init__(self):
        if not self.reason.strip():
            raise ValueError("SpecReject.reason must say why")
        supported = tuple(self.supported_k)
        if any(k < 1 for k in supported) or len(set(supported)) != len(supported):
            raise ValueError(f"SpecReject.supported_k must hold distinct draft lengths >= 1, got {list(supported)}")
        object.__setattr__(self, "supported_k", supported)


@dataclass(frozen=True)
class DraftOutput:
    """A model-owned drafter's proposal: draft_token_ids [B, K] int32 (padded), and num_valid [B] int32 in [0, K],
    how many of each row's K it offers (None: all K; 0 is the only way to offer none: never a dummy id)."""

    draft_token_ids: torch.Tensor
    num_valid: Optional[torch.Tensor] = None
    draft_scores: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class VerifyOutput:
    """What a verify returns; spec_mode says which fields are set (MODE_REQUIRED_FIELDS). argmax_ids [B, 1+K]: column
    j < K is the model's choice at candidate position j (what draft j must equal), and a row with n valid drafts finds
    its bonus at column n (upstream's layout). hidden: a handle the runner hands back to propose_draft_tokens."""

    spec_mode: str
    argmax_ids: Optional[torch.Tensor] = None
    logits: Optional[torch.Tensor] = None
    accepted_token_ids: Optional[torch.Tensor] = None
    accepted_counts: Optional[torch.Tensor] = None
    hidden: Any = None

    def __post_init__(self):
        if self.spec_mode not in MODE_REQUIRED_FIELDS:
            raise ValueError(f"VerifyOutput.spec_mode {self.spec_mode!r} is not one of {sorted(ACCEPT_MODES)}")
        missing = [name for name in MODE_REQUIRED_FIELDS[self.spec_mode] if getattr(self, name) is None]
        if missing:
            raise ValueError(f"VerifyOutput for spec_mode {self.spec_mode!r} needs {missing}")


def check_int32(call: str, name: str, tensor, shape: tuple) -> None:
    """`tensor` is an int32 torch tensor of `shape`: the runner builds every id, position and count that way."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{call} {name} must be a torch tensor, got {type(tensor).__name__}")
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{call} {name} must be {list(shape)}, got {list(tensor.shape)}")
    if tensor.dtype != torch.int32:
        raise ValueError(f"{call} {name} must be int32, got {tensor.dtype}")


def check_spec_side_tensors(num_valid_drafts, accepted_counts, rows: int, num_drafts: int, call: str = "verify"
                            ) -> None:
    """The two [B] tensors beside a block: num_valid_drafts in [0, K] (a row's real draft columns) and
    accepted_counts in [1, 1+K] (tokens the row's previous step committed: a count, never 0)."""
    for name, tensor, low, high in (("num_valid_drafts", num_valid_drafts, 0, num_drafts),
                                    ("accepted_counts", accepted_counts, 1, 1 + num_drafts)):
        if tensor is None:
            raise ValueError(f"{call} {name} must be given")
        check_int32(call, name, tensor, (rows,))
        bad = tensor[(tensor < low) | (tensor > high)]
        if bad.numel():
            raise ValueError(f"{call} {name} entries must lie in [{low}, {high}], got {bad.tolist()}")


@dataclass
class LiveRow:
    """A verify row that holds a request: its index in the block, its n valid drafts, and column 0's position."""

    row: int
    n_drafts: int
    start_pos: int
    tokens: list[int]  # columns 0..n: the last committed token and the drafts


def check_verify_block(tokens, start_pos, num_valid_drafts, accepted_counts, *, num_drafts: int, vocab_size: int
                       ) -> list[LiveRow]:
    """Every value of a verify call as the contract states it, and its live rows. A padding row holds token 0 and
    position -1 in every column, 0 valid drafts and count 1; a live row holds its tokens at consecutive positions
    from column 0 through its last valid draft, and PLACEHOLDER_TOKEN_ID at position -1 after it. Two widths come:
    the block [B, 1 + num_drafts] with [B, 1 + num_drafts] positions, and the narrow verify of model_runner.py at
    RUNNER_COMMIT on a step where no row carries a draft, [B, 1] tokens with [B] positions (num_valid_drafts all 0;
    accepted_counts still in [1, 1 + K]: that runner goes narrow after a multi-token commit too)."""
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
        raise ValueError(f"verify tokens must be a [B, 1+K] tensor (or [B, 1] on a narrow step), got "
                         f"{list(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__}")
    rows, width = tokens.shape
    narrow = width == 1
    if not narrow and width != 1 + num_drafts:
        raise ValueError(f"verify tokens is {width} columns wide, but the plan's K is {num_drafts} (a block of "
                         f"{1 + num_drafts}, or 1 on a narrow step)")
    check_int32("verify", "tokens", tokens, (rows, width))
    check_int32("verify", "start_pos", start_pos, (rows,) if narrow else (rows, width))
    check_spec_side_tensors(num_valid_drafts, accepted_counts, rows, num_drafts)
    if narrow and bool(num_valid_drafts.any()):
        raise ValueError(f"a narrow verify ([B, 1] tokens) carries no drafts, but num_valid_drafts is "
                         f"{num_valid_drafts.tolist()}")
    start_pos = start_pos.reshape(rows, width)
    live = []
    for i, (toks, pos, n, count) in enumerate(zip(tokens.tolist(), start_pos.tolist(), num_valid_drafts.tolist(),
                                                  accepted_counts.tolist())):
        if pos[0] < 0:
            for name, values, want in (("tokens", toks, 0), ("start_pos", pos, -1)):
                if any(v != want for v in values):
                    raise ValueError(f"verify {name} row {i} is a padding row (start_pos[{i}, 0] < 0) but holds "
                                     f"{values}: a padding row holds {want} in every column")
            if n != 0 or count != 1:
                raise ValueError(f"verify row {i} is a padding row but has num_valid_drafts {n} and accepted_counts "
                                 f"{count}: a padding row has 0 and 1")
            continue
        if pos[: n + 1] != list(range(pos[0], pos[0] + n + 1)):
            raise ValueError(f"verify start_pos row {i} must hold consecutive positions in columns 0..{n} (its last "
                             f"token and {n} valid drafts), got {pos[: n + 1]}")
        bad = [t for t in toks[: n + 1] if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"verify tokens row {i} has ids {bad} outside the vocabulary [0, {vocab_size}) in its "
                             f"{n + 1} real columns")
        if any(t != PLACEHOLDER_TOKEN_ID for t in toks[n + 1:]) or any(p != -1 for p in pos[n + 1:]):
            raise ValueError(f"verify row {i} has {n} valid drafts, so columns {n + 1}.. must hold token "
                             f"{PLACEHOLDER_TOKEN_ID} at position -1, got tokens {toks[n + 1:]} at {pos[n + 1:]}")
        live.append(LiveRow(i, n, pos[0], toks[: n + 1]))
    return live


def check_plain_decode(tokens, start_pos, vocab_size: int) -> list[tuple[int, int, int]]:
    """An ordinary decode call's [B, 1] tokens and [B] positions; (row, token, position) of each live row."""
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.shape[1] != 1:
        raise ValueError(f"decode tokens must be a [B, 1] tensor without spec_mode, got "
                         f"{list(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__}")
    rows = tokens.shape[0]
    check_int32("decode", "tokens", tokens, (rows, 1))
    check_int32("decode", "start_pos", start_pos, (rows,))
    live = [(i, t, p) for i, (t, p) in enumerate(zip(tokens[:, 0].tolist(), start_pos.tolist())) if p >= 0]
    bad = [t for _, t, _ in live if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"decode tokens has ids {bad} outside the vocabulary [0, {vocab_size}) on live rows")
    return live


NULL_BLOCK = 0  # vLLM's BlockPool keeps block 0 as its null block (padding in block tables): never a request's


def check_page_table(page_table, spans: Sequence[tuple[int, int, int]], num_blocks: int, block_size: int,
                     call: str) -> torch.Tensor:
    """The page table a prefill or decode brings, as int64 block ids, after every check that can be made of it: an
    integer [rows, blocks per request] tensor, and for each span (page-table row, first position written, end) the
    blocks holding positions [0, end) real (not vLLM's null block 0, within the pool of num_blocks) and distinct, none
    a row writes held by another row. Both serving models check it before anything changes: torch copies from and to
    those blocks, TT's paged_update_cache writes into them unchecked."""
    if not isinstance(page_table, torch.Tensor) or page_table.dim() != 2 or page_table.is_floating_point():
        shape = list(page_table.shape) if isinstance(page_table, torch.Tensor) else type(page_table).__name__
        raise ValueError(f"{call} page_table must be an integer tensor [rows, blocks per request], got {shape}")
    table = page_table.to(torch.int64)
    held = {}
    for row, start, end in spans:
        count = -(-end // block_size)
        if row >= table.shape[0] or count > table.shape[1]:
            raise ValueError(f"{call} page_table {list(table.shape)} has no row {row} with {count} blocks: its "
                             f"positions reach {end - 1} in blocks of {block_size}")
        blocks = table[row, :count].tolist()
        bad = [b for b in blocks if not NULL_BLOCK < b < num_blocks]
        if bad or len(set(blocks)) != len(blocks):
            raise ValueError(f"{call} page_table row {row} holds blocks {blocks} for positions 0..{end - 1}: each "
                             f"must be a distinct block in [1, {num_blocks}) (block 0 is vLLM's null block)")
        held[row] = (set(blocks), set(blocks[start // block_size:]))
    for row, (_, written) in held.items():
        for other, (blocks, _) in held.items():
            if other != row and written & blocks:
                raise ValueError(f"{call} page_table rows {row} and {other} both hold blocks "
                                 f"{sorted(written & blocks)}, which row {row} writes: a block another request "
                                 "holds (a block table of another request?)")
    return table


def check_committed_block(num_drafts: int, committed_tokens, committed_positions, accepted_counts) -> None:
    """A propose call's inputs: the [B, 1+K] committed block (the first accepted_counts[i] columns are row i's
    committed tokens at consecutive positions; padding rows have negative positions) and the counts. int32 as the
    contract states them (section 4b) and the pinned runner builds them (accept_greedy_drafts' ids, narrow steps
    included): another dtype is refused rather than cast, as check_spec_side_tensors refuses one, since it means the
    caller built something else."""
    if not isinstance(num_drafts, int) or num_drafts < 1:
        raise ValueError(f"propose num_drafts must be an int >= 1, got {num_drafts!r}")
    if not isinstance(committed_tokens, torch.Tensor) or committed_tokens.dim() != 2:
        raise ValueError("propose committed_tokens must be a [B, 1+K] tensor")
    rows = committed_tokens.shape[0]
    check_int32("propose", "committed_tokens", committed_tokens, (rows, 1 + num_drafts))
    check_int32("propose", "committed_positions", committed_positions, (rows, 1 + num_drafts))
    check_spec_side_tensors(torch.zeros(rows, dtype=torch.int32), accepted_counts, rows, num_drafts, "propose")
    for i, (pos, count) in enumerate(zip(committed_positions.tolist(), accepted_counts.tolist())):
        if pos[0] >= 0 and pos[:count] != list(range(pos[0], pos[0] + count)):
            raise ValueError(f"propose committed_positions row {i} must hold {count} consecutive positions "
                             f"(accepted_counts[{i}]), got {pos[:count]}")


def check_draft_output(drafted, rows: int, num_drafts: int, vocab_size: int) -> torch.Tensor:
    """A DraftOutput as the runner checks it before the scheduler stores it; returns num_valid as a tensor (all K where
    None). Offered ids must lie in the vocabulary; ids past a row's num_valid are not read."""
    if not all(hasattr(drafted, name) for name in ("draft_token_ids", "num_valid")):
        raise ValueError(f"propose_draft_tokens must return a DraftOutput, got {type(drafted).__name__}")
    check_int32("DraftOutput", "draft_token_ids", drafted.draft_token_ids, (rows, num_drafts))
    num_valid = drafted.num_valid
    if num_valid is None:
        num_valid = torch.full((rows,), num_drafts, dtype=torch.int32)
    check_int32("DraftOutput", "num_valid", num_valid, (rows,))
    bad = num_valid[(num_valid < 0) | (num_valid > num_drafts)]
    if bad.numel():
        raise ValueError(f"DraftOutput num_valid entries must lie in [0, {num_drafts}], got {bad.tolist()}")
    offered = torch.arange(num_drafts).unsqueeze(0) < num_valid.unsqueeze(1)
    ids = drafted.draft_token_ids[offered]
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.numel():
        raise ValueError(f"DraftOutput offers ids {bad.tolist()} outside the vocabulary [0, {vocab_size})")
    return num_valid


def accept_greedy_drafts(argmax_ids: torch.Tensor, draft_token_ids: torch.Tensor, num_valid_drafts: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The runner's greedy accept walk over a verify's argmax ids: per row, the drafts equal to the model's choice at
    their position, up to the first that is not, then the model's own choice there (the correction, or after all n
    valid drafts the bonus at column n). Returns (committed [B, 1+K] int32, the tail PLACEHOLDER_TOKEN_ID, and
    counts [B] int32 in [1, 1+K]). A padding row commits its column 0 with count 1, as any row without drafts."""
    rows, width = argmax_ids.shape
    if tuple(draft_token_ids.shape) != (rows, width - 1) or tuple(num_valid_drafts.shape) != (rows,):
        raise ValueError(f"accept walk: argmax_ids {list(argmax_ids.shape)} needs draft_token_ids [{rows}, "
                         f"{width - 1}] and num_valid_drafts [{rows}], got {list(draft_token_ids.shape)} and "
                         f"{list(num_valid_drafts.shape)}")
    committed = torch.full((rows, width), PLACEHOLDER_TOKEN_ID, dtype=torch.int32)
    counts = torch.ones(rows, dtype=torch.int32)
    for i, (ids, drafts, n) in enumerate(zip(argmax_ids.tolist(), draft_token_ids.tolist(), num_valid_drafts.tolist())):
        if PLACEHOLDER_TOKEN_ID in drafts[:n]:
            raise ValueError(f"accept walk: row {i} counts {n} valid drafts but holds the placeholder among them: "
                             f"{drafts[:n]}")
        j = 0
        while j < n and drafts[j] == ids[j]:
            j += 1
        committed[i, : j + 1] = torch.tensor(ids[: j + 1], dtype=torch.int32)
        counts[i] = j + 1
    return committed, counts


def plugin_contract():
    """The installed plugin's contract module (vllm_tt_plugin.spec_decode), or None where it is not installed."""
    try:
        import vllm_tt_plugin.spec_decode as plugin
    except ImportError:
        return None
    return plugin


def to_plugin(value):
    """`value` (SpecPlan, SpecReject, DraftOutput, VerifyOutput) as the installed plugin's own class, whose runner
    checks isinstance; unchanged where the plugin is not installed. A field the installed version lacks must be at
    its default (k_by_rows came later than some versions)."""
    plugin = plugin_contract()
    if plugin is None:
        return value
    cls = getattr(plugin, type(value).__name__)
    known = {f.name for f in fields(cls)}
    values = {f.name: getattr(value, f.name) for f in fields(value)}
    extra = {name: v for name, v in values.items() if name not in known and v != next(
        f.default for f in fields(value) if f.name == name)}
    if extra:
        raise ValueError(f"the installed vllm_tt_plugin's {cls.__name__} has no field for {sorted(extra)}")
    return cls(**{name: v for name, v in values.items() if name in known})
