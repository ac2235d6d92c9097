# SPDX-License-Identifier: Apache-2.0
"""vllm-tt-plugin's speculative-decoding contract as serving/ writes it: every shape, dtype, range, padding and refusal
rule of the values that cross, the plan's sizing to the 32-row tile, the verify's column layout, the drafter's slots
under slot_remap / release_request / note_state_slots_moved, and (where the plugin is installed; it is not
installable here) the same values against the plugin's own classes and checks."""
import random
from types import SimpleNamespace

import pytest
import torch

from models.tt_transformers.speculative.backend import StepOutput, UserRows
from models.tt_transformers.speculative.metrics import SpecDecodeCounters
from models.tt_transformers.speculative.verification import verify_chain
from models.tt_transformers.serving.contract import (
    MODEL_OWNED_DRAFTER,
    PLACEHOLDER_TOKEN_ID,
    DraftOutput,
    SpecPlan,
    SpecReject,
    VerifyOutput,
    accept_greedy_drafts,
    check_draft_output,
    check_spec_side_tensors,
    check_verify_block,
    to_plugin,
)
from models.tt_transformers.serving.core import SpecDecodeCore
from models.tt_transformers.serving.plan import SPEC_CAPABILITIES, VERIFY_TILE_ROWS, plan_speculation
from models.tt_transformers.serving.torch_model import TorchSpecDecodeModel
from models.tt_transformers.torch_backend.causal_lm import TorchCausalLM

from ..conftest import random_model
from .helpers import paged_torch_model

I32 = torch.int32


def t(values):
    return torch.tensor(values, dtype=I32)


class RuleTarget:
    """A CausalLM stand-in whose next token is a fixed rule of (token, position): its answer after a row depends on
    nothing else, so where each answer lands can be checked exactly. It records the rows of every step."""

    vocab_size, max_seq_len, max_batch_size, n_layers = 97, 64, 4, 1

    def __init__(self):
        self.steps = []

    @staticmethod
    def rule(token, pos):
        return (31 * token + 7 * pos + 11) % 97

    def step(self, rows, logits=False, top_k=0, taps=()):
        self.steps.append([(r.user, list(r.tokens), r.start_pos) for r in rows])
        ids = [[self.rule(tok, r.start_pos + j) for j, tok in enumerate(r.tokens)] for r in rows]
        top = [[[i, (i + 1) % 97][:top_k] for i in row] for row in ids] if top_k else None
        return StepOutput(ids, top_ids=top)

    def step_cost(self, n_users, n_rows, context_len):
        return 1 + 0.01 * n_rows


def core_with(slots_prompts, k=3):
    target = RuleTarget()
    core = SpecDecodeCore(target, k)
    core.prefilled(list(slots_prompts), list(slots_prompts.values()))
    return target, core, (lambda rows, top_k: target.step(rows, top_k=top_k))


def block(rows, k=3):
    """A verify block from {row: (last token, position, drafts)}; other rows of the 4 are padding."""
    tokens, pos = torch.zeros(4, 1 + k, dtype=I32), torch.full((4, 1 + k), -1, dtype=I32)
    nv, counts = torch.zeros(4, dtype=I32), torch.ones(4, dtype=I32)
    for i, (last, p, drafts) in rows.items():
        n = len(drafts)
        tokens[i] = t([last] + drafts + [PLACEHOLDER_TOKEN_ID] * (k - n))
        pos[i, : n + 1] = torch.arange(p, p + n + 1, dtype=I32)
        nv[i] = n
    return tokens, pos, nv, counts


# --- the plan -----------------------------------------------------------------------------------------------------

def test_plan_sizes_k_to_the_32_row_tile_and_names_what_fits():
    """Every (max_num_seqs, K) point: a plan iff max_num_seqs * (1 + K) <= 32, else a SpecReject quoting every K
    that fits (none from 17 requests up)."""
    for seqs in range(1, 40):
        fits = tuple(k for k in range(1, 65) if seqs * (1 + k) <= VERIFY_TILE_ROWS)
        for k in range(1, 40):
            plan = plan_speculation(None, seqs, k)
            if k in fits:
                assert isinstance(plan, SpecPlan) and plan.effective_k == k and plan.block_width == 1 + k
                assert plan.lanes_per_request == 1 + k and plan.accept_modes == ("argmax_ids",)
                assert plan.supports_narrow_decode and plan.drafter_state == "internal"
                assert plan.accepted_counts_range == (1, 1 + k)
            else:
                assert isinstance(plan, SpecReject) and plan.supported_k == fits, (seqs, k, plan)
                assert str(k) in plan.reason and str(seqs) in plan.reason
    assert plan_speculation(None, 17, 1).supported_k == () and "16" in plan_speculation(None, 17, 1).reason


@pytest.mark.parametrize("seqs,k,bad", [(None, 3, None), ("8", 3, "8"), (0, 3, 0), (-2, 3, -2), (True, 3, True),
                                        (8, None, None), (8, 0, 0), (8, -1, -1), (8, 2.0, 2.0), (8, "3", "3"),
                                        (8, False, False)])
def test_plan_never_raises_on_bad_values(seqs, k, bad):
    """A SpecReject naming the bad value, never an exception (the plugin calls spec_plan at configuration)."""
    plan = plan_speculation(None, seqs, k)
    assert isinstance(plan, SpecReject) and f"got {bad!r}" in plan.reason


def test_plan_keeps_the_block_within_max_model_len():
    config = SimpleNamespace(model_config=SimpleNamespace(max_model_len=4))
    assert plan_speculation(config, 1, 3).effective_k == 3
    reject = plan_speculation(config, 1, 4)
    assert reject.supported_k == (1, 2, 3) and "max_model_len 4" in reject.reason


@pytest.mark.parametrize("method,model", [("ngram", None), ("custom_class", "my.drafter"), ("suffix", None)])
def test_plan_refuses_a_method_the_model_owned_drafter_does_not_serve(method, model):
    """The drafter learns each request from the blocks propose_draft_tokens brings, which the plugin calls only for
    custom_class with the sentinel: any other method is a SpecReject naming the launch that works."""
    config = SimpleNamespace(speculative_config=SimpleNamespace(method=method, model=model, num_speculative_tokens=3))
    reject = plan_speculation(config, 4, 3)
    assert isinstance(reject, SpecReject) and reject.reason.startswith(f"speculative method {method!r}")
    assert f'--speculative-config \'{{"method": "custom_class", "model": "{MODEL_OWNED_DRAFTER}"' in reject.reason
    config.speculative_config.method, config.speculative_config.model = "custom_class", MODEL_OWNED_DRAFTER
    assert plan_speculation(config, 4, 3).effective_k == 3


def test_plan_constants_are_the_backends():
    """The tile is the ttnn backend's decode tile and K at most what backends size a verify for."""
    from models.tt_transformers.serving.plan import MAX_PLAN_K
    from models.tt_transformers.speculative.backend import MAX_DRAFT_TOKENS
    from models.tt_transformers.ttnn_backend.model import TILE_ROWS

    assert (VERIFY_TILE_ROWS, MAX_PLAN_K) == (TILE_ROWS, MAX_DRAFT_TOKENS)


def test_capabilities_declare_a_model_owned_drafter():
    assert SPEC_CAPABILITIES == {"supports_spec_decode": True, "spec_requirements": ["device_propose"],
                                 "spec_hidden_handoff": [], "output_tokens_per_step": 1}


@pytest.mark.parametrize("kwargs,message", [
    (dict(effective_k=0), "effective_k must be >= 1"),
    (dict(lanes_per_request=0), "lanes_per_request must be >= 1"),
    (dict(extra_bytes_per_token=-1), "extra_bytes_per_token must be >= 0"),
    (dict(accept_modes=()), "at least one accept mode"),
    (dict(accept_modes="argmax_ids"), "not the string"),
    (dict(accept_modes=("argmax",)), "unknown ['argmax']"),
    (dict(accept_modes=("argmax_ids", "argmax_ids")), "twice"),
    (dict(drafter_state="device"), "drafter_state 'device'"),
    (dict(drafter_target_cache_requires=("absolute_positions",)), "applies only to drafter_state"),
    (dict(k_by_rows=((4, 3), (2, 1))), "strictly ascending"),
    (dict(k_by_rows=((1, 5),)), "1 <= k <= effective_k"),
])
def test_spec_plan_refuses_what_the_contract_refuses(kwargs, message):
    fields = dict(effective_k=3, lanes_per_request=4, extra_bytes_per_seq=0, extra_bytes_per_token=0,
                  accept_modes=("argmax_ids",), drafter_state="internal")
    with pytest.raises(ValueError) as e:
        SpecPlan(**{**fields, **kwargs})
    assert message in str(e.value)


def test_k_by_rows_caps_by_live_rows_and_shared_caches_declare_requirements():
    plan = SpecPlan(7, 8, 0, 0, ["argmax_ids", "logits"], "shared_with_target", ["absolute_positions"],
                    k_by_rows=[(1, 7), (3, 7), (7, 3)])
    assert plan.accept_modes == ("argmax_ids", "logits") and plan.k_by_rows == ((1, 7), (3, 7), (7, 3))
    assert [plan.draft_cap(n) for n in (1, 3, 4, 7, 8)] == [7, 7, 3, 3, 0]


def test_reject_verify_and_draft_outputs_refuse_malformed_values():
    with pytest.raises(ValueError, match="must say why"):
        SpecReject("  ")
    with pytest.raises(ValueError, match="distinct draft lengths >= 1"):
        SpecReject("no", (0, 1))
    with pytest.raises(ValueError, match="distinct draft lengths >= 1"):
        SpecReject("no", (2, 2))
    with pytest.raises(ValueError, match="'greedy' is not one of"):
        VerifyOutput("greedy", argmax_ids=t([[1]]))
    with pytest.raises(ValueError, match=r"needs \['argmax_ids'\]"):
        VerifyOutput("argmax_ids", logits=torch.zeros(1, 2, 3))
    with pytest.raises(ValueError, match=r"'fused_sample' needs \['accepted_counts'\]"):
        VerifyOutput("fused_sample", accepted_token_ids=t([[1]]))


# --- side tensors and the verify block ------------------------------------------------------------------------------

@pytest.mark.parametrize("nv,counts,message", [
    (t([0, 3]), t([1, 4]), None),
    (None, t([1, 1]), "verify num_valid_drafts must be given"),
    (t([0, 4]), t([1, 1]), r"num_valid_drafts entries must lie in \[0, 3\], got \[4\]"),
    (t([0, -1]), t([1, 1]), r"num_valid_drafts entries must lie in \[0, 3\], got \[-1\]"),
    (t([0, 0]), t([0, 1]), r"accepted_counts entries must lie in \[1, 4\], got \[0\]"),
    (t([0, 0]), t([5, 1]), r"accepted_counts entries must lie in \[1, 4\], got \[5\]"),
    (torch.tensor([0, 0]), t([1, 1]), "num_valid_drafts must be int32, got torch.int64"),
    (t([0, 0, 0]), t([1, 1]), r"num_valid_drafts must be \[2\], got \[3\]"),
    (t([0, 0]), [1, 1], "accepted_counts must be a torch tensor"),
])
def test_side_tensors(nv, counts, message):
    if message is None:
        check_spec_side_tensors(nv, counts, 2, 3)
    else:
        with pytest.raises(ValueError, match=message):
            check_spec_side_tensors(nv, counts, 2, 3)


def valid_block():
    """Row 0: two drafts; row 1: padding; row 2: no draft; row 3: three drafts."""
    return block({0: (5, 10, [6, 7]), 2: (9, 3, []), 3: (1, 20, [2, 3, 4])})


def mutated(where, value):
    tokens, pos, nv, counts = valid_block()
    target = {"tokens": tokens, "start_pos": pos, "num_valid_drafts": nv, "accepted_counts": counts}[where[0]]
    target[where[1:]] = value
    return tokens, pos, nv, counts


@pytest.mark.parametrize("where,value,message", [
    (("tokens", 1, 2), 3, r"verify tokens row 1 is a padding row .* holds 0 in every column"),
    (("start_pos", 1, 3), 4, r"verify start_pos row 1 is a padding row .* holds -1 in every column"),
    (("num_valid_drafts", 1), 1, "verify row 1 is a padding row but has num_valid_drafts 1"),
    (("accepted_counts", 1), 2, "a padding row has 0 and 1"),
    (("start_pos", 0, 2), 13, r"start_pos row 0 must hold consecutive positions in columns 0..2"),
    (("tokens", 3, 2), 97, r"tokens row 3 has ids \[97\] outside the vocabulary \[0, 97\)"),
    (("tokens", 0, 0), -5, r"tokens row 0 has ids \[-5\]"),
    (("tokens", 0, 3), 8, r"verify row 0 has 2 valid drafts, so columns 3.. must hold token -1 at position -1"),
    (("start_pos", 2, 1), 4, r"verify row 2 has 0 valid drafts, so columns 1.. must hold token -1 at position -1"),
    (("num_valid_drafts", 2), 1, r"start_pos row 2 must hold consecutive positions"),
])
def test_verify_block_rules_each_named(where, value, message):
    with pytest.raises(ValueError, match=message):
        check_verify_block(*mutated(where, value), num_drafts=3, vocab_size=97)


def test_verify_block_shapes_and_live_rows():
    live = check_verify_block(*valid_block(), num_drafts=3, vocab_size=97)
    assert [(r.row, r.n_drafts, r.start_pos, r.tokens) for r in live] == [
        (0, 2, 10, [5, 6, 7]), (2, 0, 3, [9]), (3, 3, 20, [1, 2, 3, 4])]
    tokens, pos, nv, counts = valid_block()
    for args, message in [((tokens.long(), pos, nv, counts), "verify tokens must be int32"),
                          ((tokens, pos[:, :3], nv, counts), r"verify start_pos must be \[4, 4\], got \[4, 3\]"),
                          ((tokens[:, :3], pos[:, :3], nv, counts), "3 columns wide, but the plan's K is 3"),
                          ((tokens[:, :1], pos[:, :1], nv * 0, counts), r"start_pos must be \[4\], got \[4, 1\]"),
                          ((tokens[:, :1], pos[:, 0], nv, counts), r"a narrow verify .* carries no drafts"),
                          ((tokens[0], pos, nv, counts), r"\[B, 1\+K\] tensor")]:
        with pytest.raises(ValueError, match=message):
            check_verify_block(*args, num_drafts=3, vocab_size=97)


# --- the verify mapping ------------------------------------------------------------------------------------------

def test_verify_maps_each_row_onto_one_step_in_upstreams_column_layout():
    """Column j < n: the model's choice at candidate position j; the bonus at column n; everything unverified -1.
    Only live rows and their real columns are fed, each at its own positions, in one step."""
    target, core, step = core_with({0: list(range(10)), 2: list(range(3)), 3: list(range(20))})
    tokens, pos, nv, counts = valid_block()
    out = core.verify(tokens, pos, nv, counts, "argmax_ids", step)
    assert target.steps == [[(0, [5, 6, 7], 10), (2, [9], 3), (3, [1, 2, 3, 4], 20)]]
    rule = RuleTarget.rule
    expected = [[rule(5, 10), rule(6, 11), rule(7, 12), -1], [-1] * 4, [rule(9, 3), -1, -1, -1],
                [rule(1, 20), rule(2, 21), rule(3, 22), rule(4, 23)]]
    assert isinstance(out, VerifyOutput) and out.spec_mode == "argmax_ids" and out.argmax_ids.dtype == I32
    assert out.argmax_ids.tolist() == expected
    committed, n = accept_greedy_drafts(out.argmax_ids, tokens[:, 1:], nv)
    assert n.tolist() == [1, 1, 1, 1]  # the rule agrees with none of these drafts: each row commits its correction
    assert committed[:, 0].tolist() == [rule(5, 10), -1, rule(9, 3), rule(1, 20)]


def narrow_block(rows, counts=(1, 1, 1, 1)):
    """The one-column verify model_runner.py@02f45e5f sends on a step where no row carries a draft (plan with
    supports_narrow_decode): [4, 1] tokens, [4] positions, spec_mode and both side tensors; {row: (last token,
    position)}, other rows padding (token 0, position -1)."""
    tokens, pos = torch.zeros(4, 1, dtype=I32), torch.full((4,), -1, dtype=I32)
    for i, (last, p) in rows.items():
        tokens[i, 0], pos[i] = last, p
    return tokens, pos, torch.zeros(4, dtype=I32), t(list(counts))


def test_narrow_verify_of_the_pinned_runner_answers_one_column():
    """The runner pinned (model_runner.py@02f45e5f, _prepare_model_inputs) widens a step to [B, 1+K] only when some
    row carries a draft; otherwise, for a plan with supports_narrow_decode, it sends [B, 1] tokens and [B] positions
    with spec_mode and the side tensors, and walks argmax_ids [B, 1]. Each live row is fed its one token (a plain
    step's rows); a count above 1 (a multi-token commit, then no drafts) is in range; the commit is column 0."""
    target, core, step = core_with({0: list(range(10)), 2: list(range(3)), 3: list(range(20))})
    tokens, pos, nv, counts = narrow_block({0: (5, 10), 2: (9, 3), 3: (1, 20)}, counts=(2, 1, 1, 4))
    out = core.verify(tokens, pos, nv, counts, "argmax_ids", step)
    assert target.steps == [[(0, [5], 10), (2, [9], 3), (3, [1], 20)]]
    rule = RuleTarget.rule
    assert isinstance(out, VerifyOutput) and out.argmax_ids.dtype == I32
    assert out.argmax_ids.tolist() == [[rule(5, 10)], [-1], [rule(9, 3)], [rule(1, 20)]]
    committed, n = accept_greedy_drafts(out.argmax_ids, torch.zeros(4, 0, dtype=I32), nv)
    assert n.tolist() == [1, 1, 1, 1] and committed[:, 0].tolist() == out.argmax_ids[:, 0].tolist()
    drafted = propose_after(core, {0: (11, [rule(5, 10)]), 2: (4, [rule(9, 3)]), 3: (21, [rule(1, 20)])})
    assert drafted.num_valid[1] == 0  # the padding row; the live rows' contexts followed the narrow verify
    with pytest.raises(ValueError, match="a narrow verify .* carries no drafts"):
        core.verify(tokens, pos, t([1, 0, 0, 0]), counts, "argmax_ids", step)
    with pytest.raises(ValueError, match=r"accepted_counts entries must lie in \[1, 4\]"):
        core.verify(tokens, pos, nv, t([5, 1, 1, 1]), "argmax_ids", step)


def test_accepted_drafts_commit_with_the_bonus_at_column_n():
    """Drafts equal to the rule's own choices are all accepted: the walk reads the bonus at column n."""
    target, core, step = core_with({1: list(range(7))})
    d1 = RuleTarget.rule(4, 7)
    d2 = RuleTarget.rule(d1, 8)
    tokens, pos, nv, counts = block({1: (4, 7, [d1, d2])})
    out = core.verify(tokens, pos, nv, counts, "argmax_ids", step)
    committed, n = accept_greedy_drafts(out.argmax_ids, tokens[:, 1:], nv)
    assert n[1] == 3 and committed[1].tolist() == [d1, d2, RuleTarget.rule(d2, 9), -1]
    assert out.argmax_ids[1, 2] == RuleTarget.rule(d2, 9)  # the bonus at column num_valid_drafts[1]
    assert core.counters.as_dict()["vllm:spec_decode_num_accepted_tokens_per_pos_total"] == {"0": 1, "1": 1, "2": 0}


def test_verify_refuses_the_wrong_mode_width_or_slot():
    target, core, step = core_with({0: list(range(10)), 2: list(range(3)), 3: list(range(20))})
    with pytest.raises(ValueError, match="returns only 'argmax_ids'"):
        core.verify(*valid_block(), "logits", step)
    tokens, pos, nv, counts = block({0: (5, 10, [6])}, k=2)
    with pytest.raises(ValueError, match="the plan's K is 3"):
        core.verify(tokens, pos, nv, counts, "argmax_ids", step)
    tokens, pos, nv, counts = block({1: (5, 10, [6])})
    with pytest.raises(ValueError, match="no request was prefilled into slot 1"):
        core.verify(tokens, pos, nv, counts, "argmax_ids", step)
    assert target.steps == []  # refused before anything ran


def test_torch_model_call_shapes():
    """The torch backend's model, with the runner's keywords (enable_trace, read_from_device, start_pos, the page
    table and kv_cache): the three speculative arguments together or not at all, rows within its slots, prefill slots
    distinct and lengths within the padded tokens; the class declares the capabilities and the plan."""
    model = random_model(max_seq_len=32)
    served, kv, pool = paged_torch_model(TorchCausalLM(model, model.args.n_layers, 2), 3, 2, block_size=4)
    assert TorchSpecDecodeModel.model_capabilities == SPEC_CAPABILITIES
    assert TorchSpecDecodeModel.spec_plan(None, 2, 3) == plan_speculation(None, 2, 3)
    pool.cover("a", 8)
    pool.cover("b", 8)
    prefill_table, table = pool.table(["b", "a"]), pool.table(["a", "b"])
    first = served.prefill_forward(tokens=t([[1, 2, 3], [4, 5, 0]]), page_table=prefill_table, kv_cache=kv,
                                   prompt_lens=[3, 2], empty_slots=[1, 0], start_pos=t([0, 0]), enable_trace=False)
    assert first.dtype == I32 and first.shape == (2,)
    paging = dict(page_table=table, kv_cache=kv, enable_trace=True, read_from_device=False)
    tokens, pos = t([[int(first[1]), -1, -1, -1], [int(first[0]), -1, -1, -1]]), t([[2] + [-1] * 3, [3] + [-1] * 3])
    with pytest.raises(ValueError, match=r"got \['num_valid_drafts', 'spec_mode'\] alone"):
        served.decode_forward(tokens, pos, num_valid_drafts=t([0, 0]), spec_mode="argmax_ids", **paging)
    with pytest.raises(ValueError, match="3 rows, more than the 2 decode slots"):
        served.decode_forward(t([[1], [2], [3]]), t([0, 0, 0]), **paging)
    with pytest.raises(ValueError, match=r"empty_slots \[0, 0\] must be distinct"):
        served.prefill_forward(t([[1, 2], [3, 4]]), prefill_table, kv, [2, 2], [0, 0])
    with pytest.raises(ValueError, match=r"prompt_lens \[3\] within 1..2"):
        served.prefill_forward(t([[1, 2]]), prefill_table, kv, [3], [0])
    with pytest.raises(ValueError, match=r"start_pos \[2\] must each be in \[0, prompt_lens\)"):
        served.prefill_forward(t([[1, 2]]), prefill_table, kv, [2], [0], start_pos=[2])
    with pytest.raises(ValueError, match="temperature is not 0 on rows \\[0\\]"):
        served.prefill_forward(t([[1, 2]]), prefill_table, kv, [2], [0], sampling_params=SimpleNamespace(
            temperature=[0.7]))
    with pytest.raises(ValueError, match="kv_cache must be the one allocate_kv_cache returned"):
        served.decode_forward(tokens[:, :1].contiguous(), pos[:, 0].contiguous(), page_table=table, kv_cache=None)
    plain = served.decode_forward(tokens[:, :1].contiguous(), pos[:, 0].contiguous(), **paging)  # ordinary decode
    assert plain.shape == (2, 1) and plain.dtype == I32
    committed = torch.cat([plain, torch.full((2, 3), -1, dtype=I32)], dim=1)
    drafted = served.propose_draft_tokens(3, committed, t([[3, -1, -1, -1], [4, -1, -1, -1]]), t([1, 1]))
    assert drafted.draft_token_ids.shape == (2, 3) and drafted.num_valid.shape == (2,)
    out = served.decode_forward(committed, t([[3, -1, -1, -1], [4, -1, -1, -1]]), num_valid_drafts=t([0, 0]),
                                accepted_counts=t([1, 1]), spec_mode="argmax_ids", **paging)
    assert out.argmax_ids.shape == (2, 4) and out.argmax_ids[:, 1:].eq(-1).all()
    committed = torch.cat([out.argmax_ids[:, :1], torch.full((2, 3), -1, dtype=I32)], dim=1)
    served.propose_draft_tokens(3, committed, t([[4, -1, -1, -1], [5, -1, -1, -1]]), t([1, 1]))
    narrow = served.decode_forward(committed[:, :1].contiguous(), t([4, 5]), num_valid_drafts=t([0, 0]),
                                   accepted_counts=t([1, 1]), spec_mode="argmax_ids", **paging)  # model_runner.py
    assert isinstance(narrow, VerifyOutput) and narrow.argmax_ids.shape == (2, 1)


def test_the_torch_model_reads_the_blocks_its_page_table_names():
    """Two prompts prefilled into their own blocks. A decode of the first with its table gives plain decoding's
    token; with the second's blocks in its row (blocks no row of the step writes, which no check can tell from a
    shared prefix) it gives the token that continues the second prompt's keys instead. A prefill from start_pos reads
    the prefix from its blocks: the first token of a whole prefill computed the same way (prefill, then the rest)."""
    model = random_model(max_seq_len=32)
    target = TorchCausalLM(model, model.args.n_layers, 2)
    served, kv, pool = paged_torch_model(target, 3, 2, block_size=4)
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]]
    for name in "ab":
        pool.cover(name, 7)
    first = served.prefill_forward(tokens=t(prompts), page_table=pool.table(["a", "b"]), kv_cache=kv,
                                   prompt_lens=[6, 6], empty_slots=[0, 1])
    plain = TorchCausalLM(model, model.args.n_layers, 1)
    ids = served.decode_forward(t([[int(first[0])], [0]]), t([6, -1]), page_table=pool.table(["a", None]), kv_cache=kv)
    plain.prefill(0, prompts[0])
    assert int(ids[0, 0]) == plain.step([UserRows(0, [int(first[0])], 6)]).ids[0][0]
    wrong = served.paged_step([UserRows(0, [int(first[0])], 6)], 0, pool.table(["b", None]).long()).ids[0][0]
    plain.prefill(0, prompts[1])
    assert wrong == plain.step([UserRows(0, [int(first[0])], 6)]).ids[0][0] != int(ids[0, 0])
    pool.cover("c", 6)
    table = pool.table(["c"])
    table[0, 0] = pool.tables["a"][0]  # positions 0..3: the first prompt's block
    resumed = served.prefill_forward(tokens=t([prompts[0]]), page_table=table, kv_cache=kv, prompt_lens=[6],
                                     empty_slots=[1], start_pos=[4])
    plain.prefill(0, prompts[0][:4])
    assert int(resumed[0]) == plain.prefill(0, prompts[0][4:], start_pos=4).ids[0][-1]


# --- the drafter's slots -----------------------------------------------------------------------------------------

def propose_after(core, commits, k=3):
    """propose_draft_tokens with {row: (first position, committed tokens)}; other rows padding."""
    tokens, pos = torch.full((4, 1 + k), -1, dtype=I32), torch.full((4, 1 + k), -1, dtype=I32)
    counts = torch.ones(4, dtype=I32)
    for i, (p, committed) in commits.items():
        tokens[i, : len(committed)] = t(committed)
        pos[i, : len(committed)] = torch.arange(p, p + len(committed), dtype=I32)
        counts[i] = len(committed)
    return core.propose(k, tokens, pos, counts)


def test_copied_drafts_per_row_with_num_valid_and_nothing_for_padding():
    """A request repeating itself is offered its own continuation; a row with nothing to copy, a padding row and an
    empty slot are offered none (num_valid 0, the only way to offer none)."""
    periodic = [10, 11, 12, 13, 14] * 6
    target, core, step = core_with({0: periodic, 2: [50, 51]})
    tokens, pos, nv, counts = block({0: (10, 30, []), 2: (52, 2, [])})
    core.verify(tokens, pos, nv, counts, "argmax_ids", step)
    out = propose_after(core, {0: (31, [11]), 2: (3, [53])})
    assert isinstance(out, DraftOutput) and out.draft_token_ids.dtype == I32 and out.num_valid.dtype == I32
    n = out.num_valid.tolist()
    assert n[0] >= 1 and out.draft_token_ids[0, : n[0]].tolist() == [12, 13, 14, 10, 11][: n[0]]
    assert n[1:] == [0, 0, 0]  # nothing copies after [50, 51, 52, 53], a padding row, an empty slot


def test_slot_remap_moves_the_drafters_requests_once():
    """Row i takes slot remap[i]'s request once a submission is checked; a refused submission moves nothing; the same
    remap applied twice, a non-permutation and a moves note that is not the remap's are refused by name."""
    target, core, step = core_with({0: [1, 2, 3], 1: [7, 8, 9, 10]})
    tokens, pos, nv, counts = block({0: (11, 4, []), 1: (4, 3, [])})  # the two requests swapped rows
    refused = tokens.clone()
    refused[2, 0] = 5
    with pytest.raises(ValueError, match="row 2 is a padding row"):
        core.verify(refused, pos, nv, counts, "argmax_ids", step, t([1, 0, 2, 3]))
    assert core.proposer.slots == {0: 0, 1: 1}
    core.verify(tokens, pos, nv, counts, "argmax_ids", step, t([1, 0, 2, 3]))
    assert core.proposer.slots == {0: 1, 1: 0}
    core.slots_moved({1: 0, 0: 1})
    with pytest.raises(ValueError, match=r"moves \{1: 0\} are not the last slot_remap's \{\}"):
        core.slots_moved({1: 0})
    tokens, pos, nv, counts = block({0: (11, 4, [])})
    with pytest.raises(ValueError, match="a slot_remap was missed or applied twice"):
        core.verify(tokens, pos, nv, counts, "argmax_ids", step, [1, 0, 2, 3])
    with pytest.raises(ValueError, match=r"slot_remap must be a permutation of the 4 decode rows, got \[0, 0, 2, 3\]"):
        core.verify(tokens, pos, nv, counts, "argmax_ids", step, [0, 0, 2, 3])
    # the refusals moved nothing: row 0 still holds [7, 8, 9, 10] and the 11 it was fed
    core.plain_decode(t([[11], [0], [0], [0]]), t([4, -1, -1, -1]), step, [0, 1, 2, 3])
    with pytest.raises(ValueError, match=r"moves \{0: 1\} are not the last slot_remap's \{\}"):
        core.slots_moved({0: 1})  # the last submission's remap was the identity: nothing moved


def test_a_release_sends_the_response_and_the_state_goes_at_the_next_prefill():
    """A release names only a slot, and a running request may be left out of a step: the response so far joins the
    draft memory at the release, and the request's state stays until the next prefill into its slot, so a release
    that was not its own (the request goes on, after a step without it) leaves its drafting intact and sends its
    response in two parts, each token once. A slot that is not a decode slot is refused."""
    target, core, step = core_with({0: [1, 2, 3]})
    tokens, pos, nv, counts = block({0: (40, 3, [])})
    core.verify(tokens, pos, nv, counts, "argmax_ids", step)
    propose_after(core, {0: (4, [41])})
    memory = core.proposer.drafter.memory.responses.docs
    before = list(memory)
    core.release(0)
    assert list(memory) == before + [[40, 41]]  # at once: the next proposal of any request can draft from it
    core.plain_decode(t([[0]] * 4), t([-1] * 4), step)  # a step that left slot 0 out
    core.verify(*block({0: (41, 4, [])}), "argmax_ids", step)  # slot 0's request goes on: the release was not its own
    propose_after(core, {0: (5, [42])})
    core.release(0)
    core.prefilled([0], [[7, 8]])  # the next request in slot 0: the last one's state goes
    assert list(memory) == before + [[40, 41], [42]] and len(core.proposer.requests) == 1
    core.release(torch.tensor(3))  # a slot holding nothing: no change
    assert list(memory) == before + [[40, 41], [42]]
    for bad in (4, -1, "0", True, 1.0):
        with pytest.raises(ValueError, match=r"release_request slot must be a decode slot in \[0, 4\), got"):
            core.release(bad)


def test_propose_refuses_a_commit_that_does_not_follow_the_verify():
    target, core, step = core_with({0: [1, 2, 3]})
    with pytest.raises(ValueError, match="commits from position 4, but the request in slot 0 holds 3 tokens"):
        propose_after(core, {0: (4, [9])})
    tokens, pos, nv, counts = block({0: (40, 3, [5, 6])})
    core.verify(tokens, pos, nv, counts, "argmax_ids", step)
    with pytest.raises(ValueError, match=r"commits \[6, 1\], but the drafts verified were \[5, 6\]"):
        propose_after(core, {0: (4, [6, 1])})
    with pytest.raises(ValueError, match="propose row 1 holds a request, but no request was prefilled into slot 1"):
        propose_after(core, {1: (3, [5])})
    with pytest.raises(ValueError, match="num_drafts 2 is not the plan's K 3"):
        core.propose(2, *[torch.zeros(4, 3, dtype=I32)] * 2, torch.ones(4, dtype=I32))


# --- the runner's side ---------------------------------------------------------------------------------------------

def test_accept_walk_matches_verify_chain_on_random_rows():
    """The walk against the package's own verify_chain (the generator's acceptance) on 500 random rows: rejections
    at the first, a middle and the last draft, full acceptance, rows without drafts."""
    rng = random.Random(0)
    for _ in range(500):
        k = rng.randint(1, 6)
        n = rng.randint(0, k)
        target = [rng.randint(0, 4) for _ in range(k + 1)]
        drafts = [x if rng.random() < 0.7 else rng.randint(0, 4) for x in target[:n]]
        committed, count = accept_greedy_drafts(t([target]), t([drafts + [-1] * (k - n)]), t([n]))
        expected = verify_chain(drafts, target[: n + 1])
        assert committed[0].tolist() == expected + [-1] * (k + 1 - len(expected)) and count.tolist() == [len(expected)]


def test_accept_walk_refuses_a_placeholder_among_valid_drafts():
    with pytest.raises(ValueError, match=r"row 0 counts 2 valid drafts but holds the placeholder"):
        accept_greedy_drafts(t([[1, 2, 3]]), t([[1, -1]]), t([2]))


@pytest.mark.parametrize("out,message", [
    (DraftOutput(torch.zeros(2, 3, dtype=torch.int64)), "draft_token_ids must be int32"),
    (DraftOutput(torch.zeros(2, 2, dtype=I32)), r"draft_token_ids must be \[2, 3\]"),
    (DraftOutput(torch.zeros(2, 3, dtype=I32), t([0, 4])), r"num_valid entries must lie in \[0, 3\], got \[4\]"),
    (DraftOutput(torch.zeros(2, 3, dtype=I32), torch.tensor([0, 1])), "num_valid must be int32"),
    (DraftOutput(t([[1, 2, 97], [0, 0, 0]]), None), r"offers ids \[97\] outside the vocabulary"),
    (DraftOutput(t([[1, -1, -1], [0, 0, 0]]), t([2, 0])), r"offers ids \[-1\]"),
    (torch.zeros(2, 3, dtype=I32), "must return a DraftOutput"),
])
def test_draft_output_checks(out, message):
    with pytest.raises(ValueError, match=message):
        check_draft_output(out, 2, 3, 97)


def test_ids_past_num_valid_are_not_read():
    out = DraftOutput(t([[1, -1, 500], [-1, -1, -1]]), t([1, 0]))
    assert check_draft_output(out, 2, 3, 97).tolist() == [1, 0]


def test_counters_follow_vllms_observe_draft():
    c = SpecDecodeCounters(3)
    for drafted, accepted in [(3, 3), (3, 0), (2, 1), (0, 0), (1, 1)]:
        c.observe_draft(drafted, accepted)
    assert c.as_dict() == {"vllm:spec_decode_num_drafts_total": 4, "vllm:spec_decode_num_draft_tokens_total": 9,
                           "vllm:spec_decode_num_accepted_tokens_total": 5,
                           "vllm:spec_decode_num_accepted_tokens_per_pos_total": {"0": 3, "1": 1, "2": 1}}
    with pytest.raises(ValueError, match="accepted <= drafted <= num_spec_tokens"):
        c.observe_draft(4, 1)


# --- against the plugin's own classes (skipped where it is not installed) -----------------------------------------

def plugin():
    return pytest.importorskip("vllm_tt_plugin.spec_decode", reason="vllm-tt-plugin is not installable here (not on "
                               "PyPI; it needs vLLM's TT build and ttnn): these run where it is installed")


def test_our_values_are_the_plugins_classes_where_installed():
    spec = plugin()
    plan = to_plugin(plan_speculation(None, 8, 3))
    assert isinstance(plan, spec.SpecPlan) and plan.effective_k == 3 and plan.block_width == 4
    assert isinstance(to_plugin(plan_speculation(None, 8, 4)), spec.SpecReject)
    target, core, step = core_with({0: list(range(10)), 2: list(range(3)), 3: list(range(20))})
    out = to_plugin(core.verify(*valid_block(), "argmax_ids", step))
    assert isinstance(out, spec.VerifyOutput) and out.argmax_ids.shape == (4, 4)
    assert isinstance(to_plugin(propose_after(core, {0: (13, [1])})), spec.DraftOutput)


def test_checks_and_walk_agree_with_the_plugins_where_installed():
    spec = plugin()
    for nv, counts in [(t([0, 3]), t([1, 4])), (t([0, 4]), t([1, 1])), (t([0, 0]), t([0, 1])),
                       (torch.tensor([0, 0]), t([1, 1]))]:
        ours = theirs = None
        try:
            check_spec_side_tensors(nv, counts, 2, 3)
        except ValueError as e:
            ours = e
        try:
            spec.check_spec_side_tensors(nv, counts, 2, 3)
        except ValueError as e:
            theirs = e
        assert (ours is None) == (theirs is None)
    rng = random.Random(1)
    for _ in range(200):
        ids = t([[rng.randint(0, 3) for _ in range(4)] for _ in range(3)])
        n = t([rng.randint(0, 3) for _ in range(3)])
        drafts = t([[rng.randint(0, 3) if j < int(n[i]) else -1 for j in range(3)] for i in range(3)])
        ours, theirs = accept_greedy_drafts(ids, drafts, n), spec.accept_greedy_drafts(ids, drafts, n)
        assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
