# SPDX-License-Identifier: Apache-2.0
"""The trained draft head (issue 14): the target's hidden states, the head's drafts from them whatever the step
shapes, lossless greedy and sampled decoding with head drafts, the hybrid's choice, the shipped head and its card,
bad --draft_head files, and the training command end to end on a small recipe."""
import hashlib
import json
import sys

import pytest
import torch

from models.tt_transformers.demo.speculative_decoding.speculative_demo import (
    DRAFT_HEADS,
    DemoConfig,
    DemoInputError,
    encode,
    run_demo,
)
from models.tt_transformers.demo.speculative_decoding.speculative_generator import SpeculativeGenerator
from models.tt_transformers.speculative.backend import UserRows
from models.tt_transformers.speculative.draft_length import linear_cost
from models.tt_transformers.speculative.drafters import Draft, HybridDrafter, SuffixDrafter, Verified
from models.tt_transformers.speculative.head_drafter import HeadDrafter, RunCost
from models.tt_transformers.speculative.sampling import SamplingParams
from models.tt_transformers.torch_backend import checkpoint
from models.tt_transformers.torch_backend.draft_head import (
    HeadRunner,
    head_weights,
    load_draft_head,
    read_draft_head,
    save_draft_head,
)
from models.tt_transformers.torch_backend.generator import TorchCausalLM
from models.tt_transformers.torch_backend.model_config import ModelArgs

from .conftest import REPO_ROOT, needs_cpu_kernels, random_head, random_model, write_json
from .test_lossless_greedy import head_drafter, run, run_results
from .test_lossless_sampling import (
    ALPHA,
    N_DRAFT,
    N_TOKENS,
    PROMPT,
    SETTINGS,
    chi_square_p_value,
    exact_joint,
    sampled_counts,
)

SHIPPED = DRAFT_HEADS / "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def shipped_head(embedded_bf16):
    return load_draft_head(SHIPPED, embedded_bf16)


# ---- the target's hidden states --------------------------------------------------------------------------------

@pytest.mark.parametrize("kernels", [pytest.param(True, marks=needs_cpu_kernels), False], ids=["cpu-kernels", "torch-ops"])
def test_hidden_states_are_what_the_lm_head_reads(embedded_checkpoint, embedded_bf16, kernels):
    """The backend's hidden states are the final norm's output: the LM head applied to them gives its logits, and a
    verification step's rows equal the same positions decoded one at a time."""
    model = embedded_bf16 if kernels else checkpoint.load_model(embedded_checkpoint, torch.bfloat16, 256,
                                                                cpu_kernels=False)
    lm = TorchCausalLM(model, model.args.n_layers, 1)
    prompt = [1, 504, 3575, 282, 314, 2115, 30]
    pre = lm.prefill(0, prompt, hidden=True)
    assert pre.hidden[0].shape == (len(prompt), model.args.dim)
    logits = model.output(pre.hidden[0][-1:]).float()
    assert torch.equal(logits.argmax(-1), torch.tensor(pre.ids[0]))
    many = lm.step([UserRows(0, [11, 12, 13, 14], len(prompt))], hidden=True).hidden[0]
    lm.prefill(0, prompt)
    one_by_one = torch.cat([lm.step([UserRows(0, [t], len(prompt) + i)], hidden=True).hidden[0]
                            for i, t in enumerate([11, 12, 13, 14])])
    assert torch.equal(many, one_by_one)


# ---- the head's drafts ---------------------------------------------------------------------------------------------

@needs_cpu_kernels
def test_head_drafts_do_not_depend_on_step_shapes(embedded_bf16, shipped_head, sample_prompt_tokens):
    """The same text reached by one-token steps (plain decoding) or by one verification step of many tokens, and
    the head fed in one catch-up run or in chunks: the same features, so the same drafts and confidences."""
    prompt = sample_prompt_tokens[0]
    text = run(embedded_bf16, [prompt], 0, 0, 12)[0]

    def drafts_after(step_sizes, max_rows):
        target = TorchCausalLM(embedded_bf16, embedded_bf16.args.n_layers, 1)
        runner = HeadRunner(shipped_head, 1)
        runner.max_rows = max_rows
        drafter = HeadDrafter(runner)
        drafter.cost = RunCost(0.0, measure=False)
        out = target.prefill(0, prompt, hidden=True)
        drafter.start([0], [prompt], SamplingParams(), out.hidden)
        context, fed = list(prompt) + text[:1], 1
        for n in step_sizes:  # the target verifies text[fed - 1 : fed + n - 1], accepting all but the last row's
            rows = text[fed - 1 : fed - 1 + n]
            step = target.step([UserRows(0, rows, len(context) - 1)], hidden=True)
            drafter.accept(0, Verified(rows[1:] + step.ids[0][-1:], list(range(n - 1)), rows, None, step.hidden[0]))
            context += rows[1:] + step.ids[0][-1:]
            fed += n
        assert context == list(prompt) + text[:fed]
        draft = drafter.propose([0], [context], [6], linear_cost(0.0))[0]
        return draft.tokens, drafter.pending[0].confidences, drafter.known[0].shape[0], drafter.fed_len[0]

    reference = drafts_after([1] * 8, 256)
    assert reference[0], "the shipped head drafts after a chat prompt's first tokens"
    assert drafts_after([8], 256) == reference
    assert drafts_after([3, 1, 4], 256) == reference
    assert drafts_after([2, 6], 5) == reference  # the prompt's catch-up in runs of 5 rows


def test_hybrid_takes_the_draft_expected_to_bring_more():
    """The copied draft when its value (tokens per unit of work) beats the head's, else the head's; a copied draft
    that is withdrawn learns nothing from the head's verification."""
    class Fixed:
        top_k, wants_hidden = 0, True

        def __init__(self, expected):
            self.expected, self.calls, self.accepted = expected, [], []

        def start(self, users, prompts, sampling, hidden=None):
            pass

        def draft_value(self, user, n, extra_cost):
            return (1 + self.expected) / (1 + extra_cost(n))

        def propose(self, users, contexts, max_tokens, extra_cost, trees=False):
            self.calls.append(list(users))
            return [Draft([7, 7], "head", expected=self.expected) for _ in users]

        def accept(self, user, verified):
            self.accepted.append(user)

    context = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]  # the automaton copies "4 1 2 3" with a long match
    for head_expected, source in ((0.5, "suffix"), (6.0, "head")):
        suffix, head = SuffixDrafter(1), Fixed(head_expected)
        hybrid = HybridDrafter(suffix, head)
        hybrid.start([0, 1], [context, [9]], SamplingParams())
        drafts = hybrid.propose([0, 1], [context, [9, 8]], [4, 4], linear_cost(0.0))
        assert drafts[0].source == source and drafts[1].source == "head"  # user 1 has nothing to copy
        assert (0 in head.calls[0]) == (source == "head")
        assert (0 in suffix.pending) == (source == "suffix")
        hybrid.accept(0, Verified([4], [], [3] + drafts[0].tokens))
        assert head.accepted == [0]


# ---- lossless ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["head", "hybrid-head"])
def test_shipped_head_identical_to_plain_and_accepted(embedded_bf16, embedded_tokenizer, sample_prompt_tokens, mode,
                                                      shipped_head):
    """The shipped head on the sample prompts, batched, with the length policy as the demo runs it: outputs equal
    plain greedy decoding, and its drafts are accepted (it agrees with the target far more than chance)."""
    eos = [embedded_tokenizer.eos_token_id]
    prompts = sample_prompt_tokens[:4]
    plain = [run(embedded_bf16, [p], 0, 0, 40, eos=eos)[0] for p in prompts]
    target = TorchCausalLM(embedded_bf16, embedded_bf16.args.n_layers, len(prompts))
    head = head_drafter(target, shipped_head, eager=False)
    head.cost = RunCost(head.cost.estimate, measure=False)  # at this CPU's measured run cost the head rarely pays
    drafter = head if mode == "head" else HybridDrafter(SuffixDrafter(1, recycle=4), head)
    results = SpeculativeGenerator(target, drafter, 6, eos).generate(prompts, 40)
    assert [r.output_tokens for r in results] == plain
    steps = [it for r in results for it in r.iterations if it.draft_source == "head"]
    drafted, accepted = sum(it.drafted for it in steps), sum(it.accepted for it in steps)
    assert drafted > 0 and accepted / drafted > 0.3, (accepted, drafted)


@pytest.mark.parametrize("kernels", [pytest.param(True, marks=needs_cpu_kernels), False], ids=["cpu-kernels", "torch-ops"])
def test_random_heads_identical_to_plain(kernels):
    """Random heads over part of the vocabulary on random models: greedy output is plain decoding's, batched, at the
    end of the cache and with every draft length."""
    steps = []
    for seed in range(3):
        model = random_model(torch.bfloat16, seed=seed, dim=64, head_dim=32, hidden_dim=96, vocab_size=50)
        if kernels:
            from .conftest import CPU_KERNELS

            model.use_cpu_kernels(CPU_KERNELS)
        prompts = [[1, 2, 3, 4, 1, 2], [5], [7, 8, 9, 10, 11, 12, 13]]
        plain = [run(model, [p], 0, 0, 60)[0] for p in prompts]
        for n_draft in (1, 4, 9):
            results = run_results(model, prompts, n_draft, 1, 60, mode="head")
            assert [r.output_tokens for r in results] == plain
            steps += [it for r in results for it in r.iterations]
    assert sum(it.drafted for it in steps) > 0 and sum(it.accepted for it in steps) > 0


@pytest.mark.parametrize("kind", ["head", "head-negative-control"])
def test_sampling_with_head_drafts_matches_the_target(kind, monkeypatch):
    """Chi-square over the first 5 sampled tokens of a 4-token model with a random head over 3 of the 4 tokens (q is
    zero on the fourth): rejection sampling keeps the target's distribution; accepting every draft does not."""
    from models.tt_transformers.demo.speculative_decoding import speculative_generator
    from models.tt_transformers.speculative import sampling as sampling_module

    from .test_lossless_sampling import make_tiny_model

    tiny = make_tiny_model()
    head = random_head(tiny, seed=5, std=0.6, vocab_share=0.75)
    assert len(head.vocab) == 3
    if kind == "head-negative-control":
        monkeypatch.setattr(speculative_generator, "verify_rejection", lambda draft, q, p, rng: list(draft) + [
            sampling_module.sample(p[len(draft)], rng)])
    counts, full_chains, *_ = sampled_counts(tiny, lambda target: head_drafter(target, head), N_DRAFT, SETTINGS, 100)
    p_value = chi_square_p_value(counts, exact_joint(tiny, SETTINGS))
    if kind == "head":
        assert p_value > ALPHA
        assert full_chains >= 100 * 32 // 4, full_chains  # whole chains of N_DRAFT head drafts were verified
    else:
        assert p_value < ALPHA


# ---- the shipped head, its card and bad files ---------------------------------------------------------------------

def test_shipped_head_matches_its_card(embedded_checkpoint):
    """The weights in the repository are the ones the card describes (hash, vocabulary size, parameter count), for
    the embedded model, with the measured acceptance the training command wrote."""
    card = json.loads((SHIPPED / "card.json").read_text())
    weights = read_draft_head(SHIPPED, ModelArgs.from_hf_config(embedded_checkpoint.config))
    assert card["weights_sha256"] == hashlib.sha256((SHIPPED / "head.safetensors").read_bytes()).hexdigest()
    assert card["draft_vocabulary"]["size"] == len(weights["vocab"])
    assert card["parameters"] == sum(t.numel() for name, t in weights.items() if name != "vocab")
    assert card["target"] == embedded_checkpoint.name and card["command"].startswith("make train-draft-head")
    assert card["measured_on_held_out_topics"]["tokens_per_target_forward"] > 1.5


def head_files(tmp_path, embedded_bf16, **changes):
    """A copy of a head for the embedded model with some tensors replaced."""
    folder = tmp_path / "head"
    save_draft_head(head_weights(random_head(embedded_bf16, vocab_share=0.01, attach=False)), folder, {"target": "test"})
    from safetensors.torch import load_file, save_file

    weights = {**load_file(folder / "head.safetensors"), **changes}
    save_file({k: v for k, v in weights.items() if v is not None}, folder / "head.safetensors")
    return folder


def bad_head(case, tmp_path, model):
    if case == "missing":
        return tmp_path / "nowhere"
    if case == "garbage":
        (tmp_path / "g").mkdir()
        (tmp_path / "g" / "head.safetensors").write_bytes(b"not a safetensors file")
        return tmp_path / "g"
    return head_files(tmp_path, model, **{
        "other_width": {"fc.weight": torch.zeros(64, 128)},
        "no_vocab": {"vocab": None},
        "other_tokenizer": {"vocab": torch.tensor([5, 60000], dtype=torch.int32)},
        "no_layer": {"block.attention.wqkv.weight": None},
    }[case])


@pytest.mark.parametrize("case,message", [
    ("missing", "--draft_head .* has no head.safetensors; point --draft_head at a folder written by"),
    ("garbage", "cannot be read as safetensors"),
    ("other_width", r"fc.weight is \(64, 128\), but this target needs \(576, 1152\).*make train-draft-head"),
    ("no_vocab", "no draft vocabulary"),
    ("other_tokenizer", r"ids outside the target's \[0, 49152\)"),
    ("no_layer", r"block.attention.wqkv.weight is missing"),
])
def test_bad_draft_head_is_a_clear_error_before_loading(tmp_path, embedded_bf16, monkeypatch, case, message):
    """Checked against the target's config before any model loads; the message names --draft_head and the fix."""
    folder = bad_head(case, tmp_path, embedded_bf16)
    monkeypatch.setattr(checkpoint, "load_model", lambda *a, **k: pytest.fail("a model was loaded before the check"))
    config = DemoConfig(input_prompts=str(write_json(tmp_path / "p.json", [{"prompt": "Hi"}])), draft_mode="head",
                        draft_head=str(folder), max_generated_tokens=4)
    with pytest.raises(DemoInputError, match=message):
        run_demo(config)


def test_head_mode_without_a_head_for_the_target(tmp_path, monkeypatch):
    from models.tt_transformers.demo.speculative_decoding import speculative_demo

    monkeypatch.setattr(speculative_demo, "DRAFT_HEADS", tmp_path / "none")
    config = DemoConfig(input_prompts=str(write_json(tmp_path / "p.json", [{"prompt": "Hi"}])), draft_mode="head")
    with pytest.raises(DemoInputError, match="no draft head ships for SmolLM2-135M-Instruct; pass --draft_head"):
        run_demo(config)


def test_demo_head_and_hybrid_use_the_shipped_head(tmp_path, monkeypatch):
    """The demo's head and hybrid modes draft with the shipped head and report its run cost. The cost is pinned to
    the head's weight-based estimate, so whether the head drafts does not depend on this machine's timing (the
    measured cost is RunCost's own, tested with it)."""
    monkeypatch.setattr(RunCost, "value", property(lambda self: self.estimate))
    prompts = write_json(tmp_path / "p.json", [{"prompt": "What is the capital of France?"}])
    for mode in ("head", "hybrid"):
        report = run_demo(DemoConfig(input_prompts=str(prompts), draft_mode=mode, max_generated_tokens=24))
        assert report["summary"]["identical_to_baseline"]
        assert any(it["draft_source"] == "head" for it in report["prompts"][0]["iterations"])
        assert 0 < report["summary"]["draft_head_run_cost"] < 1  # the estimate: a run costs a fraction of a step


# ---- training ------------------------------------------------------------------------------------------------------

def test_training_command_end_to_end(tmp_path):
    """`make train-draft-head` on a tiny recipe: prompts, the target's responses and states, training, evaluation,
    head.safetensors + card.json that the demo loads."""
    sys.path.insert(0, str(REPO_ROOT / "tools"))
    import train_draft_head

    out = tmp_path / "head"
    train_draft_head.main(["--out", str(out), "--topics", "6", "--tasks_per_topic", "1", "--word_problems", "2",
                           "--max_tokens", "12", "--stage_one_tokens", "16", "--epochs", "1", "--vocab_size", "512",
                           "--batch", "8"])
    card = json.loads((out / "card.json").read_text())
    assert card["weights_sha256"] == hashlib.sha256((out / "head.safetensors").read_bytes()).hexdigest()
    assert card["draft_vocabulary"]["size"] == 512 and card["training"]["steps"] > 0
    assert card["measured_on_held_out_topics"]["positions"] > 0
    report = run_demo(DemoConfig(input_prompts=str(write_json(tmp_path / "p.json", [{"prompt": "Hi"}])),
                                 draft_mode="head", draft_head=str(out), max_generated_tokens=8))
    assert report["summary"]["identical_to_baseline"]
