# SPDX-License-Identifier: Apache-2.0
"""The demo in each draft mode on the embedded model: the device it picks, a corpus, draft heads (shipped, given,
trained by `make train-draft-head`, bad), and its defaults end to end (slow)."""
import hashlib
import json
import sys

import pytest
from loguru import logger

from models.tt_transformers.demo.speculative_decoding import inputs
from models.tt_transformers.demo.speculative_decoding.inputs import DemoInputError
from models.tt_transformers.demo.speculative_decoding.options import DemoConfig
from models.tt_transformers.demo.speculative_decoding.speculative_demo import run_demo
from models.tt_transformers.speculative.drafters.eagle3 import HeadDrafter
from models.tt_transformers.speculative.drafters.eagle3_base import RunCost
from models.tt_transformers.checkpoints import eagle3_format
from models.tt_transformers.torch_backend import load
from models.tt_transformers.checkpoints.model_shape import ModelShape

from ..conftest import REPO_ROOT, write_eagle3_head, write_json


def test_demo_logs_its_device_choice(tmp_path, embedded_checkpoint):
    messages = []
    sink = logger.add(lambda m: messages.append(m.record["message"]))
    try:
        report = run_demo(DemoConfig(input_prompts=str(write_json(tmp_path / "p.json", [{"prompt": "Hi"}])),
                                     max_generated_tokens=4, compare_baseline=0, draft_mode="suffix"))
    finally:
        logger.remove(sink)
    chosen = [m for m in messages if m.startswith("Device ")]
    assert len(chosen) == 1 and report["environment"]["device"] == chosen[0].split(":")[0].split()[1]


def test_corpus_drafts_in_the_demo(tmp_path, embedded_checkpoint):
    """--draft_corpus: text the requests repeat drafts from the start, output identical to plain decoding."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("The quick brown fox jumps over the lazy dog near the riverbank every morning.\n")
    prompts = write_json(tmp_path / "p.json", [{"prompt": "Repeat this sentence exactly: The quick brown fox jumps "
                                                         "over the lazy dog near the riverbank every morning."}])
    report = run_demo(DemoConfig(input_prompts=str(prompts), draft_mode="suffix", draft_corpus=str(corpus),
                                 draft_memory=0, max_generated_tokens=24))
    assert report["summary"]["identical_to_baseline"]
    with pytest.raises(DemoInputError, match="--draft_corpus .* does not exist"):
        run_demo(DemoConfig(input_prompts=str(prompts), draft_corpus=str(tmp_path / "missing.txt")))


def bad_head(case, tmp_path, args):
    """A --draft_head value that must be refused, for the embedded model (args)."""
    if case == "missing":
        return tmp_path / "nowhere"
    if case == "hub-id-not-cached":
        return "someone/not-downloaded"
    if case == "a-file":
        (tmp_path / "f.safetensors").write_bytes(b"x")
        return tmp_path / "f.safetensors"
    if case == "not-eagle3":
        (tmp_path / "llama").mkdir()
        write_json(tmp_path / "llama" / "config.json", {"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
        return tmp_path / "llama"
    small = ModelShape(**{**args.__dict__, "dim": 64, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16, "hidden_dim": 96})
    target = {"other-width": small, "other-tokenizer": ModelShape(**{**args.__dict__, "vocab_size": 32000})}.get(case, args)
    folder = write_eagle3_head(tmp_path / "head", target, "speculators", std=0.01, draft_vocab=256,
                               taps={"taps-out-of-range": (2, 15, 40)}.get(case, (2, 15, 27)))
    if case in ("no-d2t", "missing-tensor", "truncated"):
        from safetensors.torch import load_file, save_file

        weights = load_file(folder / "model.safetensors")
        weights.pop({"no-d2t": "d2t", "missing-tensor": "layers.0.hidden_norm.weight"}.get(case, "t2d"))
        save_file(weights, folder / "model.safetensors")
        if case == "truncated":
            data = (folder / "model.safetensors").read_bytes()
            (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    if case == "d2t-outside-vocab":
        from safetensors.torch import load_file, save_file

        weights = load_file(folder / "model.safetensors")
        weights["d2t"] = weights["d2t"] + 60000
        save_file(weights, folder / "model.safetensors")
    return folder


@pytest.mark.parametrize("case,message", [
    ("missing", r"--draft_head '.*nowhere' does not exist; give the head's folder or a hub id"),
    ("hub-id-not-cached", r"--draft_head 'someone/not-downloaded' is a Hugging Face hub id, but it is not in the local"),
    ("a-file", r"--draft_head '.*f.safetensors' is a file; point it at the head's folder"),
    ("not-eagle3", r"config.json describes 'LlamaForCausalLM', not an EAGLE-3 head"),
    ("other-width", r"the head reads hidden size 64 \(its own 64\), but this target's is 576: a head for another"),
    ("other-tokenizer", r"the head's vocabulary has 32000 tokens, this target's 49152 \(another tokenizer\)"),
    ("taps-out-of-range", r"eagle_aux_hidden_state_layer_ids \[2, 15, 40\] must be layers of this 30-layer target"),
    ("no-d2t", r"d2t is missing, expected \(256,\): a head with a smaller draft vocabulary needs its d2t map"),
    ("missing-tensor", r"layers.0.hidden_norm.weight is missing, expected \(576,\)"),
    ("truncated", r"model.safetensors cannot be read .* it is corrupt or incomplete: download or train the head again"),
    ("d2t-outside-vocab", r"d2t maps draft ids outside the target's vocabulary"),
    ("fewer-target-layers", r"reads layers \[2, 15, 27\], but --target_layers keeps 12; keep all 30 layers or pass a "
                            r"--draft_head for 12 layers"),
])
def test_bad_draft_head_is_a_clear_error_before_loading(tmp_path, embedded_checkpoint, monkeypatch, case, message):
    """Checked against the target's config before any model loads; one line naming --draft_head and the fix."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    value = bad_head(case, tmp_path, ModelShape.from_hf_config(embedded_checkpoint.config))
    monkeypatch.setattr(load, "load_model", lambda *a, **k: pytest.fail("a model was loaded before the check"))
    config = DemoConfig(input_prompts=str(write_json(tmp_path / "p.json", [{"prompt": "Hi"}])), draft_mode="head",
                        draft_head=str(value), max_generated_tokens=4,
                        target_layers=12 if case == "fewer-target-layers" else None)
    with pytest.raises(DemoInputError, match=message) as error:
        run_demo(config)
    assert "\n" not in str(error.value)


def test_head_mode_without_a_head_for_the_target(tmp_path, monkeypatch):
    monkeypatch.setattr(eagle3_format, "DRAFT_HEADS", tmp_path / "none")
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


def drafts_with(drafter) -> tuple:
    """What a drafter drafts with: its kind, its copied drafts' settings, its head (config and draft vocabulary) or
    its draft model's layers."""
    other = getattr(drafter, "fallback", drafter)
    suffix = getattr(drafter, "suffix", None)
    head = getattr(other, "head", None)
    return (type(drafter), type(other),
            suffix and (suffix.threshold, suffix.memory.responses.max_tokens, suffix.top_k),
            head and (head.head.config, head.vocab.tolist(), head.cache.k[0].shape),
            getattr(other, "lm", None) and (other.lm.n_layers, other.lm.shares_target_cache))


@pytest.mark.parametrize("flags,library", [
    ({}, {}),  # the defaults: a hybrid with the shipped head
    ({"draft_mode": "head"}, {"draft_mode": "head"}),
    ({"target_layers": 12}, {}),  # the shipped head taps layers a truncated target does not run: the draft model
    ({"draft_head": "none"}, {"draft_head": "none"}),
])
def test_the_library_default_drafts_as_the_demo(tmp_path, flags, library):
    """make_drafter(SpeculativeConfig(...), target) builds the drafter the demo builds for the same settings (the
    demo through the library's pieces: its checks choose the head, the backend builds it): the same kinds, the same
    head (the shipped one, or none), the same draft model."""
    from models.tt_transformers.demo.speculative_decoding.build import build
    from models.tt_transformers.speculative import SpeculativeConfig, make_drafter

    config = DemoConfig(input_prompts=str(write_json(tmp_path / "p.json", [{"prompt": "Hi"}])), **flags)
    target, drafter = build(config, inputs.check_inputs(config))[1:3]
    ours = make_drafter(SpeculativeConfig(**library), target)
    assert drafts_with(ours) == drafts_with(drafter)
    assert (drafts_with(ours)[1] is HeadDrafter) == (flags.get("target_layers") is None and "draft_head" not in flags)


def test_training_command_end_to_end(tmp_path):
    """`make train-draft-head` on a tiny recipe: prompts, the target's responses and taps, training, evaluation (held
    out and one benchmark set), a head in speculators' layout + card.json that the demo loads."""
    sys.path.insert(0, str(REPO_ROOT / "tools"))
    import train_draft_head

    out = tmp_path / "head"
    train_draft_head.main(["--out", str(out), "--topics", "6", "--tasks_per_topic", "1", "--word_problems", "2",
                           "--max_tokens", "12", "--stage_one_tokens", "16", "--epochs", "1", "--vocab_size", "512",
                           "--batch", "8", "--questions_per_topic", "1", "--batch_tokens", "512", "--eval_sets", "qa"])
    card = json.loads((out / "card.json").read_text())
    assert card["weights_sha256"] == hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    assert card["draft_vocabulary"]["size"] == 512 and card["training"]["updates"] > 0
    assert card["measured_on_held_out_topics"]["positions"] > 0
    assert card["measured_on_benchmark_sets"]["qa"]["positions"] > 0
    assert json.loads((out / "config.json").read_text())["speculators_model_type"] == "eagle3"
    report = run_demo(DemoConfig(input_prompts=str(write_json(tmp_path / "p.json", [{"prompt": "Hi"}])),
                                 draft_mode="head", draft_head=str(out), max_generated_tokens=8))
    assert report["summary"]["identical_to_baseline"]


@pytest.mark.slow
@pytest.mark.parametrize("draft_mode,batch_size", [("hybrid", 1), ("suffix", 1), ("model", 1), ("hybrid", 8)])
def test_demo_defaults_identical_to_plain(draft_mode, batch_size):
    """The sample prompts x 128 tokens (the demo's defaults), every draft mode, batch 1 and 8."""
    report = run_demo(DemoConfig(draft_mode=draft_mode, batch_size=batch_size))
    assert report["summary"]["identical_to_baseline"]
    assert len(report["prompts"]) == 5 and report["summary"]["mean_tokens_per_step"] >= 1.0
