# SPDX-License-Identifier: Apache-2.0
"""Bad input gets a clear error naming the problem and the fix; converted weights are cached."""
import importlib.util
import json
import os
import re
import resource
import subprocess
import sys
import time

import numpy as np
import pytest
from loguru import logger

from models.tt_transformers.checkpoints import checkpoint
from models.tt_transformers.torch_backend import load
from models.tt_transformers.checkpoints.checkpoint import CheckpointError, resolve_checkpoint
from models.tt_transformers.checkpoints.model_shape import ModelShape, ModelConfigError
from models.tt_transformers.demo.speculative_decoding.inputs import (
    DemoInputError,
    check_flags,
    check_inputs,
    load_prompts,
    split_batches,
)
from models.tt_transformers.demo.speculative_decoding.options import DEFAULT_PROMPTS, DemoConfig
from models.tt_transformers.demo.speculative_decoding.report import ReportFile
from models.tt_transformers.demo.speculative_decoding.speculative_demo import main, run_demo
from models.tt_transformers.speculative.generator import SpeculativeGenerator
from models.tt_transformers.speculative.drafters import SuffixDrafter
from models.tt_transformers.torch_backend.causal_lm import TorchCausalLM

from ..conftest import REPO_ROOT, random_model, save_tiny_hf_checkpoint, write_json

DOCUMENTED_PROMPTS = "models/tt_transformers/demo/speculative_decoding/sample_prompts.json"
DEMO_SCRIPT = REPO_ROOT / DOCUMENTED_PROMPTS.replace("sample_prompts.json", "speculative_demo.py")


def test_prompts_tt_json_and_jsonl(tmp_path):
    assert load_prompts(str(write_json(tmp_path / "p.json", [{"prompt": "a"}, {"prompt": "b"}]))) == ["a", "b"]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "x", "id": 1}\n\n{"prompt": "y"}\n')
    assert load_prompts(str(jsonl)) == ["x", "y"]


def test_single_line_jsonl_is_one_prompt(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "only one"}\n')
    assert load_prompts(str(path)) == ["only one"]


@pytest.mark.parametrize("content,message", [
    ("not json at all {", "--input_prompts .*neither JSON nor JSON Lines"),
    ("[]", "--input_prompts .*holds no prompts"),
    ('[{"text": "a"}]', '--input_prompts .*entry 0 has no string "prompt"'),
    ('[{"prompt": "  "}]', "--input_prompts .*entry 0 has an empty prompt; give it some text or remove it"),
    ('{"prompt": ""}', "--input_prompts .*entry 0 has an empty prompt"),  # one-line JSON Lines, its prompt empty
])
def test_malformed_prompts_file(tmp_path, content, message):
    path = tmp_path / "p.json"
    path.write_text(content)
    with pytest.raises(DemoInputError, match=message):
        load_prompts(str(path))


def test_prompts_file_errors_name_the_line_the_encoding_and_the_kind(tmp_path):
    """A bad JSON Lines line is reported by its own number; a non-UTF-8 file and a folder each get their own message."""
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "fine"}\n{"prompt": broken}\n')
    with pytest.raises(DemoInputError, match="--input_prompts .*line 2: Expecting value at column 12"):
        load_prompts(str(path))
    path.write_bytes('[{"prompt": "caf\u00e9"}]'.encode("latin-1"))
    with pytest.raises(DemoInputError, match="--input_prompts .*not UTF-8 text .*save it as UTF-8"):
        load_prompts(str(path))
    with pytest.raises(DemoInputError, match=f"--input_prompts '{tmp_path}' is a directory"):
        load_prompts(str(tmp_path))


def test_unwritable_output_json_stops_before_anything_runs(tmp_path):
    """The report's file is created where it will be written before the run: a folder that refuses files whatever
    its permission bits say (/proc) is found then, not after the run; nothing is left of a refused path."""
    (tmp_path / "file").write_text("")
    for path, message in ((tmp_path / "file" / "r.json", "cannot be written .*Not a directory"),
                          (tmp_path, "is a directory"), ("/proc/out.json", "cannot be written")):
        with pytest.raises(DemoInputError, match=f"--output_json .*{message}"):
            ReportFile(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
    assert os.access("/proc", os.W_OK) or os.geteuid() != 0  # what let /proc pass a permission check


def test_a_failed_run_leaves_no_report_and_a_whole_one_is_renamed(tmp_path, embedded_checkpoint):
    """--output_json in folders that do not exist yet: a run that fails after the reservation leaves neither the
    file nor the folders; a run that succeeds leaves the report alone, no temporary file beside it."""
    no_tokenizer = tmp_path / "tiny"
    save_tiny_hf_checkpoint(no_tokenizer)
    with pytest.raises(CheckpointError, match=f"--model '{no_tokenizer}' has no tokenizer files \\(tokenizer.json, "
                                              "tokenizer.model, vocab.json\\); copy the tokenizer files"):
        run_demo(demo(tmp_path, model=str(no_tokenizer), max_seq_len=64,
                      output_json=str(tmp_path / "new" / "sub" / "r.json")))
    assert not (tmp_path / "new").exists()
    run_demo(demo(tmp_path, draft_mode="suffix", max_generated_tokens=2, output_json=str(tmp_path / "out" / "r.json")))
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["r.json"]


def test_ttnn_backend_without_ttnn_is_one_line(monkeypatch, capsys):
    """Here (no ttnn installed) --backend ttnn or MESH_DEVICE stops with one line naming what it needs; Ctrl-C stops
    with one line and exit status 130."""
    from models.tt_transformers.demo.speculative_decoding import speculative_demo

    assert importlib.util.find_spec("ttnn") is None
    with pytest.raises(DemoInputError, match="needs tt-metal v0.81.1's Python environment .*use --backend torch"):
        check_flags(DemoConfig(), "ttnn")
    monkeypatch.setenv("MESH_DEVICE", "N150")
    assert speculative_demo.main([]) == 2
    monkeypatch.delenv("MESH_DEVICE")

    def interrupted(config, mesh_device=None, pool=None):
        raise KeyboardInterrupt
    monkeypatch.setattr(speculative_demo, "run_demo", interrupted)
    assert speculative_demo.main([]) == 130


def test_missing_prompts_file():
    with pytest.raises(DemoInputError, match="--input_prompts '/nonexistent/prompts.json' does not exist"):
        load_prompts("/nonexistent/prompts.json")


def test_documented_prompts_path_works_from_anywhere(tmp_path, monkeypatch):
    """The seed demo's documented --input_prompts path, from the repository root and from another folder (as from a
    tt-metal checkout); the top-level sample_prompts.json is the same file, not a copy that could drift."""
    monkeypatch.chdir(REPO_ROOT)
    expected = load_prompts(DOCUMENTED_PROMPTS)
    assert expected == load_prompts(str(DEFAULT_PROMPTS)) and len(expected) == 8
    monkeypatch.chdir(tmp_path)
    assert load_prompts(DOCUMENTED_PROMPTS) == expected
    assert os.path.samefile(REPO_ROOT / "sample_prompts.json", DEFAULT_PROMPTS)


def test_batch_split_repeats_to_fill():
    assert split_batches(5, 2) == [[0, 1], [2, 3], [4, 0]]
    assert split_batches(2, 4) == [[0, 1, 0, 1]]
    with pytest.raises(DemoInputError, match="batch_size 3 is not supported"):
        split_batches(5, 3)


def test_missing_checkpoint_and_missing_weights(tmp_path, monkeypatch):
    with pytest.raises(CheckpointError, match="HF_MODEL/--model .* does not exist"):
        resolve_checkpoint(str(tmp_path / "nope"))
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setenv("HF_MODEL", str(tmp_path))
    with pytest.raises(CheckpointError, match="no \\*.safetensors weights"):
        resolve_checkpoint(None)


def cached_hub_model(cache, repo_id, commit="0123abcd"):
    """A checkpoint laid out as huggingface_hub caches it: blobs, a snapshot of links to them, refs/main."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    save_tiny_hf_checkpoint(repo / "blobs-src")
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for f in (repo / "blobs-src").iterdir():
        blob = repo / "blobs" / f"{f.name}-blob"
        blob.parent.mkdir(exist_ok=True)
        f.rename(blob)
        (snapshot / f.name).symlink_to(blob)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.mark.parametrize("env", ["HF_HUB_CACHE", "HF_HOME"])
def test_hub_id_resolves_from_the_local_cache(tmp_path, monkeypatch, env):
    cache = tmp_path / "hub"
    snapshot = cached_hub_model(cache, "meta-llama/Tiny-Llama")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv(env, str(cache if env == "HF_HUB_CACHE" else tmp_path))
    monkeypatch.setenv("HF_MODEL", "meta-llama/Tiny-Llama")
    ckpt = resolve_checkpoint(None)
    assert ckpt.folder == snapshot and ckpt.name == "Tiny-Llama"
    assert load.load_model(ckpt, load.torch.float32, 32).args.n_layers == 4


def test_uncached_hub_id_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(CheckpointError, match="not in the local Hugging Face cache .*huggingface-cli download "
                                              "meta-llama/Llama-3.1-8B-Instruct"):
        resolve_checkpoint("meta-llama/Llama-3.1-8B-Instruct")


def test_unsupported_model_type():
    with pytest.raises(ModelConfigError, match="model_type 'gpt2' is not supported"):
        ModelShape.from_hf_config({"model_type": "gpt2"})


def test_missing_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    save_tiny_hf_checkpoint(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.2.mlp.down_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="model.layers.2.mlp.down_proj.weight"):
        load.load_model(resolve_checkpoint(str(tmp_path)), load.torch.float32, 64)


def demo(tmp_path, **kw):
    cfg = dict(input_prompts=str(write_json(tmp_path / "p.json", [{"prompt": "Hello"}])), max_generated_tokens=6,
               compare_baseline=0)
    cfg.update(kw)
    return DemoConfig(**cfg)


@pytest.mark.parametrize("overrides,message", [
    ({"draft_layers": 30, "draft_mode": "model"}, "--draft_layers 30 must be between 1 and 29 .*lower it to at most 29"),
    ({"draft_layers": 0, "draft_mode": "model"}, "--draft_layers must be a whole number >= 1 \\(leave it out for "
                                                 "the default\\), got 0"),
    ({"draft_layers": 6, "target_layers": 6, "draft_mode": "model"}, "--draft_layers 6 must be between 1 and 5 .*lower it to at most 5"),
    ({"target_layers": 31}, "--target_layers 31 is out of range: .* use 1 to 30"),
    ({"target_layers": 0}, "--target_layers must be >= 1"),
    ({"draft_model": "/no/such/draft"}, "--draft_model '/no/such/draft' does not exist"),
    ({"model": "/no/such/target"}, "--model '/no/such/target' does not exist"),
    ({"device": "tpu"}, "--device 'tpu' is not one of auto, cpu, cuda"),
    ({"n_draft_tokens": -1}, "--n_draft_tokens must be a whole number between 0 and 64"),
    ({"n_draft_tokens": 1000}, "--n_draft_tokens must be a whole number between 0 and 64"),
    ({"max_seq_len": 8}, "leaves no room to generate within max_seq_len=8"),
    ({"batch_size": 5}, "--batch_size 5 is not supported"),
    ({"dtype": "int4"}, "--dtype 'int4' is not supported"),
    ({"draft_mode": "ngram"}, "--draft_mode 'ngram' is not one of model, suffix, head, hybrid"),
    ({"sa_threshold": 0}, "--sa_threshold must be a whole number >= 1"),
    ({"temperature": -0.5}, "--temperature must be a finite number >= 0 \\(0 = greedy\\), got -0.5"),
    ({"top_p": 0.0}, "--top_p must be a finite number in \\(0, 1\\]"),
    ({"top_k": -3}, "--top_k must be a whole number >= 0"),
    ({"temperature": float("nan")}, "--temperature must be a finite number >= 0 \\(0 = greedy\\), got nan"),
    ({"temperature": float("inf")}, "--temperature must be a finite number >= 0 \\(0 = greedy\\), got inf"),
    # sampling flags without --temperature: greedy would ignore them
    ({"top_k": 50}, "^--top_k 50 only applies when sampling, and --temperature 0 is greedy; set --temperature above 0 "
                    "to sample, or leave --top_k out$"),
    ({"top_p": 0.9}, "^--top_p 0.9 only applies when sampling, and --temperature 0 is greedy"),
    ({"seed": 7}, "^--seed 7 only applies when sampling, and --temperature 0 is greedy; set --temperature above 0 to "
                  "sample, or leave --seed out$"),
    ({"instruct": 5}, "--instruct must be 0 or 1, got 5"),
    ({"draft_trees": -1}, "--draft_trees must be 0 or 1, got -1"),
    ({"compare_baseline": 7}, "--compare_baseline must be 0 or 1, got 7"),
    ({"input_prompts": ""}, "--input_prompts is empty; give it a value or leave it out"),
    ({"output_json": " "}, "--output_json is empty; give it a value or leave it out"),
    ({"log_iterations": -2}, "--log_iterations must be >= 0, or -1 for every iteration, got -2"),
])
def test_demo_rejects_bad_flags(tmp_path, embedded_checkpoint, overrides, message):
    with pytest.raises(ValueError, match=message):
        run_demo(demo(tmp_path, **overrides))


def test_draft_corpus_must_be_a_text_file(tmp_path, embedded_checkpoint):
    """As a binary prompts file is refused, so is a binary corpus; a folder is called a folder."""
    corpus = tmp_path / "corpus"
    cases = ((b"text, then \xff\xfe", "not UTF-8 text \\(byte 11\\)"),
             (b"ELF\x00\x01", "holds NUL bytes, so it is not text"))
    for content, message in cases:
        corpus.write_bytes(content)
        with pytest.raises(DemoInputError, match=f"--draft_corpus {corpus}: {message}; pass a text file"):
            check_inputs(demo(tmp_path, draft_corpus=str(corpus)))
    with pytest.raises(DemoInputError, match=f"--draft_corpus '{tmp_path}' is a directory; pass a text file"):
        check_inputs(demo(tmp_path, draft_corpus=str(tmp_path)))


@pytest.mark.parametrize("flag", ["model", "draft_model"])
@pytest.mark.parametrize("content,message", [("garbage", "is not valid JSON \\(line 1 column 1: Expecting value\\)"),
                                             ("[1, 2]", "holds a JSON list, not the model's settings")])
def test_damaged_config_json_is_named_with_its_flag(tmp_path, embedded_checkpoint, flag, content, message):
    """A garbage config.json is one line naming the flag and the file, for the target and for the draft model alike
    (it was a bare JSON error for --model and a traceback for --draft_model)."""
    folder = tmp_path / "damaged"
    folder.mkdir()
    (folder / "config.json").write_text(content)
    messages, sink = logged_errors()
    try:
        assert main(["--input_prompts", str(write_json(tmp_path / "p.json", [{"prompt": "Hi"}])), "--draft_mode",
                     "model", f"--{flag}", str(folder)]) == 2
    finally:
        logger.remove(sink)
    assert len(messages) == 1 and re.fullmatch(f"--{flag} '{folder}': its config.json {message}; download the "
                                               "checkpoint's config.json again", messages[0]), messages


def test_mismatched_draft_tokenizer(tmp_path, embedded_checkpoint):
    from transformers import AutoTokenizer

    draft = tmp_path / "draft"
    save_tiny_hf_checkpoint(draft, vocab_size=49152)
    tok = AutoTokenizer.from_pretrained(embedded_checkpoint.folder)
    tok.add_tokens(["<an_extra_token>"])
    tok.save_pretrained(draft)
    with pytest.raises(DemoInputError, match="different tokenizer"):
        run_demo(demo(tmp_path, draft_model=str(draft)))


def test_draft_model_of_another_vocabulary_is_one_line(tmp_path, embedded_checkpoint):
    """--draft_model with a 32,000-token Mistral beside the 49,152-token target (and the target's tokenizer files, so
    the tokenizer check passes): one line naming the flag and both vocabularies, before anything loads (it was a
    62-line traceback from the draft's embedding)."""
    draft = tmp_path / "mistral"
    save_tiny_hf_checkpoint(draft, "mistral", vocab_size=32000, num_hidden_layers=2)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (draft / name).write_bytes((embedded_checkpoint.folder / name).read_bytes())
    messages, sink = logged_errors()
    try:
        assert main(["--input_prompts", str(write_json(tmp_path / "p.json", [{"prompt": "Hi"}])), "--draft_mode",
                     "model", "--draft_model", str(draft), "--max_generated_tokens", "4", "--compare_baseline",
                     "0"]) == 2
    finally:
        logger.remove(sink)
    assert messages == [f"--draft_model {draft}: its vocabulary has 32,000 tokens, SmolLM2-135M-Instruct's 49,152; "
                        "pass a draft model of the target's family (its tokenizer), or use --draft_mode suffix"], (
                           messages)


def test_draft_model_folder_without_config_names_the_flag(tmp_path, embedded_checkpoint):
    (tmp_path / "draft").mkdir()
    with pytest.raises(ValueError, match="--draft_model .* has no config.json; point --draft_model at"):
        run_demo(demo(tmp_path, draft_model=str(tmp_path / "draft")))


def logged_errors():
    messages = []
    sink = logger.add(lambda m: messages.append(m.record["message"]), level="ERROR")
    return messages, sink


def test_cli_prints_clear_error_without_traceback(tmp_path, embedded_checkpoint):
    messages, sink = logged_errors()
    try:
        assert main(["--input_prompts", str(tmp_path / "missing.json")]) == 2
    finally:
        logger.remove(sink)
    assert messages == [f"--input_prompts {str(tmp_path / 'missing.json')!r} does not exist; pass a JSON or JSON Lines "
                        f"prompts file (default: {DEFAULT_PROMPTS})"]


def test_cli_samples_without_a_seed(tmp_path, embedded_checkpoint):
    """--temperature without --seed (torch.seed() values once overflowed the per-user seed arithmetic)."""
    prompts = write_json(tmp_path / "p.json", [{"prompt": "Hello"}])
    out = tmp_path / "r.json"
    assert main(["--input_prompts", str(prompts), "--temperature", "0.7", "--max_generated_tokens", "6",
                 "--batch_size", "4", "--output_json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["config"]["seed"] is None and len(report["prompts"][0]["output_tokens"]) >= 1


def test_report_carries_tt_perf_keys_vllm_figures_and_environment(tmp_path, embedded_checkpoint):
    """--output_json: TT's perf keys; vLLM's serving figures (TTFT, TPOT, ITL, E2EL: mean and P50/P95/P99) and
    spec-decode counters, both recomputed here from each prompt's token times and iterations; the environment."""
    prompts = write_json(tmp_path / "p.json", [{"prompt": "Hello"}, {"prompt": "Count from one to twenty in words."}])
    assert main(["--input_prompts", str(prompts), "--draft_mode", "suffix", "--max_generated_tokens", "24",
                 "--output_json", str(tmp_path / "r.json")]) == 0
    written = json.loads((tmp_path / "r.json").read_text())
    summary, prompts = written["summary"], written["prompts"]
    # recomputed from each user's own figures (batch 1: one user per batch), not from summarize()'s variables
    produced = [len(p["output_tokens"]) - 1 for p in prompts]
    decode_s = sum(n / p["decode_tok_s"] for n, p in zip(produced, prompts))
    assert summary["decode_t/s/u"] == pytest.approx(sum(produced) / decode_s) and summary["decode_t/s"] > 0
    ttft_s = [p["ttft_ms"] / 1e3 for p in prompts]
    assert summary["prefill_time_to_token"] == pytest.approx(sum(ttft_s) / len(ttft_s)) and summary["prefill_t/s"] > 0
    latencies = {"ttft": [], "tpot": [], "itl": [], "e2el": []}
    for p in prompts:  # a chunk per iteration, each gap at least that iteration's own time
        times, iterations = p["token_times_ms"], p["iterations"]
        assert len(times) == len(iterations) + 1
        assert all(b - a >= it["ms"] for a, b, it in zip(times, times[1:], iterations))
        latencies["ttft"].append(times[0])
        latencies["e2el"].append(times[-1])
        latencies["tpot"].append((times[-1] - times[0]) / (len(p["output_tokens"]) - 1))
        latencies["itl"] += [b - a for a, b in zip(times, times[1:])]
    for metric, values in latencies.items():
        assert summary[f"mean_{metric}_ms"] == pytest.approx(np.mean(values))
        for q in (50, 95, 99):
            assert summary[f"p{q}_{metric}_ms"] == pytest.approx(np.percentile(values, q))
    drafts = [(it["drafted"], it["accepted"]) for p in prompts for it in p["iterations"] if it["drafted"]]
    assert summary["spec_decode"] == {
        "vllm:spec_decode_num_drafts_total": len(drafts),
        "vllm:spec_decode_num_draft_tokens_total": sum(d for d, _ in drafts),
        "vllm:spec_decode_num_accepted_tokens_total": sum(a for _, a in drafts),
        "vllm:spec_decode_num_accepted_tokens_per_pos_total": {str(j): sum(a > j for _, a in drafts) for j in range(4)}}
    assert summary["spec_decode"]["vllm:spec_decode_num_accepted_tokens_total"] > 0
    baseline = summary["baseline"]
    assert baseline["spec_decode"]["vllm:spec_decode_num_drafts_total"] == 0 and baseline["p99_itl_ms"] > 0
    env = written["environment"]
    assert env["device"] == "cpu" and env["torch"] and env["cpu_count"] >= 1
    assert env["git_commit"] is None or len(env["git_commit"]) == 40
    assert env["omp_num_threads"] == os.environ.get("OMP_NUM_THREADS") and env["torch_threads"] >= 1
    load = written["summary"]["load"]  # what else ran while each run was timed, for judging its figures
    assert set(load) == {"speculative", "plain"}
    assert all(phase["other_processes_cores"] >= 0 and phase["wall_s"] > 0 for phase in load.values())
    assert isinstance(written["summary"]["warnings"], list)


class SlowStartDrafter(SuffixDrafter):
    """A drafter whose start (the draft model's prefill, for a model drafter) takes a known time."""

    def start(self, users, prompts, sampling, hidden=None):
        time.sleep(0.25)
        super().start(users, prompts, sampling, hidden)


def test_drafter_start_counts_as_decode_time():
    """The draft side's prefill happens between the first token and the second: it is decode time, so a
    speedup computed from decode_s includes it."""
    target = TorchCausalLM(random_model(), 3, 2)
    results = SpeculativeGenerator(target, SlowStartDrafter(), 4).generate([[1, 2, 3], [4, 5]], 3)
    assert all(r.decode_s >= 0.25 for r in results)


def test_gguf_conversion_is_cached_and_atomic(tmp_path, monkeypatch):
    """Second resolve is instant and reuses the stamp; no temporary folder is left behind."""
    monkeypatch.setenv("TT_CACHE_PATH", str(tmp_path))
    calls = []
    real = checkpoint._convert_gguf
    monkeypatch.setattr(checkpoint, "_convert_gguf", lambda *a: (calls.append(a), real(*a)))
    first = resolve_checkpoint(None)
    second = resolve_checkpoint(None)
    assert first == second and len(calls) == 1  # the second resolve converted nothing
    assert json.loads((first.folder / "source.json").read_text())["gguf"].endswith(checkpoint.EMBEDDED_GGUF)
    assert [p.name for p in first.folder.parent.iterdir()] == ["hf"]


def test_the_converted_tokenizer_keeps_the_ggufs_special_tokens(embedded_checkpoint, embedded_tokenizer):
    """SmolLM2's GGUF adds no BOS and ends a response with <|im_end|>; so does its converted tokenizer, on
    transformers 4.53 (tt-metal's pin, whose conversion adds BOS to every text and takes BOS for EOS) as on 5.x."""
    from models.tt_transformers.prompts import encode, eos_token_ids

    tokenizer = embedded_tokenizer
    assert encode(tokenizer, "Hi there", False) == tokenizer("Hi there", add_special_tokens=False).input_ids
    assert tokenizer.eos_token == "<|im_end|>" and eos_token_ids(embedded_checkpoint, tokenizer) == [2]


@pytest.mark.parametrize("mode", ["suffix", "hybrid", "head", "model"])
@pytest.mark.parametrize("draft_layers", [0, 30, 1000])
def test_draft_layers_checked_in_every_mode(tmp_path, embedded_checkpoint, mode, draft_layers):
    """An out-of-range --draft_layers (0, all 30 layers, 1000) is one line in every draft mode, whether or not that
    mode ends up building the draft model (hybrid with the shipped head does not)."""
    message = ("--draft_layers must be a whole number >= 1" if draft_layers < 1 else
               f"--draft_layers {draft_layers} must be between 1 and 29")
    with pytest.raises(DemoInputError, match=message):
        check_inputs(demo(tmp_path, draft_mode=mode, draft_layers=draft_layers))


@pytest.mark.parametrize("mode", ["suffix", "hybrid", "head", "model"])
def test_default_draft_layers_never_stop_a_run(tmp_path, embedded_checkpoint, mode):
    """On a target of 8 layers (the default --draft_layers) plain decoding and every draft mode check out: a mode
    that builds the draft model (hybrid too: the shipped head reads layers past 8) fits the default to half the
    target and says so; an explicit value stays checked."""
    for n_draft_tokens in (0, 4):
        config = demo(tmp_path, target_layers=8, draft_mode=mode, n_draft_tokens=n_draft_tokens)
        if mode == "head" and n_draft_tokens:  # the one mode with no draft model to fall back on
            with pytest.raises(DemoInputError, match="--draft_mode head: the shipped head reads layers .* but "
                                                     "--target_layers keeps 8"):
                check_inputs(config)
            continue
        checked = check_inputs(config)
        builds_draft_model = n_draft_tokens > 0 and mode in ("model", "hybrid")
        assert checked.draft_layers == (4 if builds_draft_model else None) and not checked.unused
        fitted = [note for note in checked.notes if note.startswith("--draft_layers")]
        assert fitted == (["--draft_layers not given: the draft model is the first 4 of the target's 8 layers (the "
                           "default 8 needs a deeper target)"] if builds_draft_model else [])
    with pytest.raises(DemoInputError, match="--draft_layers 8 must be between 1 and 7 .*or leave it out"):
        check_inputs(demo(tmp_path, target_layers=8, draft_mode=mode, draft_layers=8))
    if mode == "model":
        with pytest.raises(DemoInputError, match="--draft_mode model drafts with the target's first layers, and the "
                                                 "1-layer target has none to spare; pass --draft_model"):
            check_inputs(demo(tmp_path, target_layers=1, draft_mode=mode))


@pytest.mark.parametrize("overrides,unused", [
    ({"draft_mode": "suffix", "draft_model": "/no/such/draft", "draft_layers": 4, "draft_head": "/no/such/head"},
     ["--draft_head (read by --draft_mode head or hybrid, not suffix)",
      "--draft_model (--draft_mode suffix builds no draft model)",
      "--draft_layers (--draft_mode suffix builds no draft model)"]),
    ({"draft_layers": 8}, ["--draft_layers (hybrid drafts with the draft head)"]),  # the README's first example
    ({"n_draft_tokens": 0, "draft_model": "/no/such/draft", "draft_corpus": str(DEFAULT_PROMPTS)},
     ["--draft_model (plain decoding (--n_draft_tokens 0) drafts nothing)",
      "--draft_corpus (plain decoding (--n_draft_tokens 0) drafts nothing)"]),
    ({"draft_mode": "model", "draft_corpus": str(DEFAULT_PROMPTS)},
     ["--draft_corpus (copied drafts are made by --draft_mode suffix or hybrid, not model)"]),
    ({"draft_mode": "hybrid", "draft_model": "/no/such/draft", "draft_layers": 4}, None),  # not unused: resolved
])
def test_draft_flags_a_mode_does_not_read_are_named(tmp_path, embedded_checkpoint, overrides, unused):
    """--draft_head, --draft_model, --draft_layers and --draft_corpus are treated alike: given to a run that does not
    read them, each is named with why, and the run goes on; a used --draft_model is still checked."""
    if unused is None:
        with pytest.raises(ValueError, match="--draft_model '/no/such/draft' does not exist"):
            check_inputs(demo(tmp_path, **overrides))
    else:
        assert check_inputs(demo(tmp_path, **overrides)).unused == unused


def test_fitted_draft_layers_and_unused_flags_are_logged(tmp_path, embedded_checkpoint):
    """The run itself logs the fitted default and the unused flag, once each, and drafts with 4 layers."""
    lines = []
    sink = logger.add(lambda m: lines.append(m.record["message"]), level="INFO")
    try:
        report = run_demo(demo(tmp_path, target_layers=8, draft_mode="model", draft_corpus=str(DEFAULT_PROMPTS),
                               compare_baseline=1))
    finally:
        logger.remove(sink)
    assert sum("--draft_layers not given: the draft model is the first 4" in line for line in lines) == 1
    assert lines.count("Not used by this run: --draft_corpus (copied drafts are made by --draft_mode suffix or "
                       "hybrid, not model)") == 1
    assert any("Drafting: draft model first 4 layers" in line for line in lines)
    assert report["summary"]["identical_to_baseline"]


def test_max_seq_len_beyond_the_model_or_the_memory(tmp_path, embedded_checkpoint, monkeypatch):
    """--max_seq_len past the model's context, or whose KV cache would not fit the free memory, is one line naming
    what fits, before anything is allocated."""
    from models.tt_transformers.demo.speculative_decoding import inputs

    with pytest.raises(DemoInputError, match="--max_seq_len 10,000,000 is longer than the model's context"):
        check_inputs(demo(tmp_path, max_seq_len=10_000_000))
    monkeypatch.setattr(inputs, "available_memory_bytes", lambda: 64 * 2**20)  # 64 MiB free
    with pytest.raises(DemoInputError, match="--max_seq_len 8,192: its KV cache .* does not fit .* use at most 2,912"):
        check_inputs(demo(tmp_path, max_seq_len=8192))


def test_demo_batch_4_sampling(tmp_path, embedded_checkpoint):
    """--batch_size 4 --temperature 0.7: one prompt fills the batch by repetition and is reported once; a seeded
    run repeats itself exactly and samples plain sampling's tokens."""
    cfg = dict(batch_size=4, temperature=0.7, seed=0, max_generated_tokens=12, draft_mode="suffix",
               stop_at_eos=0, compare_baseline=1)
    first = run_demo(demo(tmp_path, **cfg, output_json=str(tmp_path / "r.json")))
    assert len(first["prompts"]) == 1 and len(first["prompts"][0]["output_tokens"]) == 12
    assert first["summary"]["identical_to_baseline"] and first["summary"]["speedup"] > 0
    assert json.loads((tmp_path / "r.json").read_text())["config"]["temperature"] == 0.7
    assert run_demo(demo(tmp_path, **cfg))["prompts"][0]["output_tokens"] == first["prompts"][0]["output_tokens"]
    unseeded = run_demo(demo(tmp_path, **{**cfg, "seed": None}))  # the pytest path with no --seed
    assert len(unseeded["prompts"][0]["output_tokens"]) == 12


def test_truncated_checkpoints_are_named_and_leave_nothing(tmp_path, monkeypatch):
    """A safetensors file or a GGUF cut short: one line naming the file as corrupt or incomplete, and no folder left
    in the cache by a failed conversion."""
    import torch

    from models.tt_transformers.torch_backend.load import load_model

    folder = tmp_path / "tiny"
    save_tiny_hf_checkpoint(folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=f"{weights} is corrupt or incomplete"):
        load_model(resolve_checkpoint(str(folder)), torch.float32, 64)
    weights.write_bytes(b"\x40" + b"\x00" * 7 + b'{"a": ')  # a header cut inside its JSON
    with pytest.raises(CheckpointError, match="is corrupt or incomplete"):
        load_model(resolve_checkpoint(str(folder)), torch.float32, 64)
    gguf = checkpoint.embedded_gguf()
    cut = tmp_path / "models" / gguf.name
    cut.parent.mkdir()
    cut.write_bytes(gguf.read_bytes()[:200_000])
    monkeypatch.setenv("TT_CACHE_PATH", str(tmp_path / "cache"))
    with pytest.raises(CheckpointError, match=f"{cut} is corrupt or incomplete"):
        resolve_checkpoint(str(cut))
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def test_unwritable_tt_cache_path_is_named(tmp_path, monkeypatch):
    """TT_CACHE_PATH where nothing can be written: one line naming TT_CACHE_PATH and the fix (the C builds fall back
    with a warning; the embedded model's conversion cannot)."""
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("TT_CACHE_PATH", str(tmp_path / "file" / "cache"))
    with pytest.raises(CheckpointError, match="TT_CACHE_PATH .* cannot be created .*set TT_CACHE_PATH to a folder you "
                                              "can write"):
        resolve_checkpoint(None)


def test_first_screen_reads_in_120_columns(tmp_path):
    """What the demo prints first: no warm-up iterations before the header, the header and iteration lines within a
    120-column terminal in the CLI's log format, prompts echoed shortened, and a per-prompt table at the end."""
    from loguru import logger

    from models.tt_transformers.demo.speculative_decoding.speculative_demo import LOG_FORMAT

    lines = []
    sink = logger.add(lambda message: lines.extend(str(message).rstrip("\n").split("\n")), format=LOG_FORMAT,
                      colorize=False)
    long_prompt = "Rename x to y in this text: " + "x = x + 1; " * 40
    try:
        run_demo(DemoConfig(input_prompts=str(write_json(tmp_path / "p.json", [{"prompt": "Hi"}, {"prompt": long_prompt}])),
                            max_generated_tokens=12, batch_size=1))
    finally:
        logger.remove(sink)
    header = next(i for i, line in enumerate(lines) if "Speculative decoding:" in line)
    assert not any("Iteration" in line for line in lines[:header])
    drafting = next(i for i, line in enumerate(lines) if "Drafting:" in line)
    wide = [line for line in lines if ("Iteration" in line or "Speculative decoding:" in line) and len(line) > 120]
    assert not wide, wide
    assert all(len(line) <= 120 for line in lines[drafting: drafting + 4])
    assert not any(long_prompt in line for line in lines)  # echoed shortened
    table = next(i for i, line in enumerate(lines) if line.endswith("Per prompt:"))
    assert lines[table + 1].startswith("prompt") and len(lines) > table + 2
    assert lines[table + 2].startswith("Hi ") and lines[table + 3].startswith("Rename x to y")


def test_max_generated_tokens_past_the_cache_is_said_once(tmp_path, embedded_checkpoint):
    """Generation that the KV cache will cut short is said once, with the --max_seq_len that holds it; the answer
    then stops at the end of the cache."""
    warnings = []
    sink = logger.add(lambda m: warnings.append(m.record["message"]), level="WARNING")
    try:
        report = run_demo(demo(tmp_path, instruct=0, max_seq_len=16, max_generated_tokens=40, stop_at_eos=0,
                               draft_mode="suffix"))
    finally:
        logger.remove(sink)
    prompt_tokens = 16 - len(report["prompts"][0]["output_tokens"])
    assert [w for w in warnings if w.startswith("--max_generated_tokens")] == [f"--max_generated_tokens 40: the longest prompt ({prompt_tokens} tokens) leaves room for "
                        f"{16 - prompt_tokens} within --max_seq_len 16; answers that reach it stop there "
                        f"(--max_seq_len {prompt_tokens + 40} holds them all)"]


def run_demo_script(args, **kwargs):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **kwargs.pop("env", {})}
    return subprocess.run([sys.executable, str(DEMO_SCRIPT), *args], capture_output=True, text=True, env=env,
                          timeout=300, **kwargs)


def test_ctrl_c_while_torch_imports_is_one_line(tmp_path):
    """Ctrl-C before the modules have loaded (a torch whose import is interrupted stands in for the keypress) stops
    with the same one line and exit status 130 as later."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise KeyboardInterrupt\n")
    out = run_demo_script([], env={"PYTHONPATH": str(tmp_path)})
    assert (out.returncode, out.stderr, out.stdout) == (130, "interrupted (Ctrl-C): stopped, no report written\n", "")


CACHE_GIB = 2.8  # --max_seq_len 8192 x --batch_size 16 on the embedded model: the cache the limit below refuses
ADDRESS_SPACE_LIMIT = 2_500_000_000  # bytes: the demo runs in ~1.3 GB of address space with a small cache


@pytest.mark.skipif(sys.platform != "linux", reason="needs Linux's RLIMIT_AS")
def test_cache_the_free_memory_allows_but_a_limit_refuses(tmp_path, embedded_checkpoint):
    """A KV cache that the free-memory check lets through but the process cannot allocate (an address-space limit, as
    `ulimit -v` sets) is one line naming --max_seq_len and --batch_size, exit status 2."""
    from models.tt_transformers.demo.speculative_decoding.inputs import available_memory_bytes

    if (available_memory_bytes() or 0) < 1.5 * CACHE_GIB * 2**30:
        pytest.skip(f"needs {1.5 * CACHE_GIB:.1f} GiB free, so that the free-memory check passes the cache")
    out = run_demo_script(["--input_prompts", str(write_json(tmp_path / "p.json", [{"prompt": "Hi"}])),
                           "--draft_mode", "suffix", "--device", "cpu", "--max_seq_len", "8192", "--batch_size", "16"],
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_LIMIT,) * 2))
    errors = [line for line in out.stderr.splitlines() if "ERROR" in line]
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert len(errors) == 1 and errors[0].endswith(
        f"--max_seq_len 8,192 x --batch_size 16: this process could not allocate the KV cache ({CACHE_GIB} GiB); "
        "lower --max_seq_len or --batch_size, or raise the process's memory limit"), errors


def test_cli_flag_errors_are_one_line(capsys):
    """argparse's own errors (a value of the wrong type, a misspelt flag) are one line too, not the usage of every
    flag."""
    for argv, message in ((["--temperature", "abc"], "argument --temperature: invalid float value: 'abc'"),
                          (["--draft_layerz", "4"], "unrecognized arguments: --draft_layerz 4")):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        lines = capsys.readouterr().err.splitlines()
        assert exit_.value.code == 2 and len(lines) == 1 and message in lines[0], lines


def test_pytest_form_bad_option_is_a_usage_error(tmp_path):
    """The pytest form with a bad option fails as pytest's own usage errors do: one line, exit status 4, no source
    listing, nothing run."""
    out = subprocess.run([sys.executable, "-m", "pytest", f"{DEMO_SCRIPT}::test_speculative_demo", "--batch_size", "3",
                          "-q", "-p", "no:cacheprovider"], capture_output=True, text=True, cwd=REPO_ROOT, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == pytest.ExitCode.USAGE_ERROR, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stderr.strip() == "ERROR: --batch_size 3 is not supported; use one of (1, 2, 4, 8, 16, 32)"
    assert "def test_speculative_demo" not in out.stdout and "passed" not in out.stdout


def test_pytest_form_load_error_is_one_line(tmp_path):
    """What only loading finds (here a folder without tokenizer files) fails the pytest form with its one line, no
    source listing either."""
    save_tiny_hf_checkpoint(tmp_path / "tiny")
    out = subprocess.run([sys.executable, "-m", "pytest", f"{DEMO_SCRIPT}::test_speculative_demo", "-q", "-p",
                          "no:cacheprovider", "--model", str(tmp_path / "tiny"), "--max_seq_len", "64"],
                         capture_output=True, text=True, cwd=REPO_ROOT, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == pytest.ExitCode.TESTS_FAILED, out.stdout[-2000:] + out.stderr[-2000:]
    assert f"--model '{tmp_path / 'tiny'}' has no tokenizer files" in out.stdout
    assert "def test_speculative_demo" not in out.stdout and "Traceback" not in out.stdout


@pytest.mark.parametrize("flags,refused", [(dict(draft_mode="suffix"), False), (dict(draft_mode="model"), False),
                                           (dict(draft_mode="hybrid"), True), (dict(draft_mode="head"), True),
                                           (dict(draft_mode="suffix", temperature=0.7), True)])
def test_grouped_verify_only_where_its_programs_serve_the_run(flags, refused):
    """--grouped_verify 1: its grouped verify programs return greedy ids only (no sampling logits, no taps), so a
    sampled run or one whose drafts read taps is refused before anything loads, in one line naming the flags."""
    config = DemoConfig(grouped_verify=1, **flags)
    if refused:
        with pytest.raises(DemoInputError, match=r"^--grouped_verify 1 runs greedy verify steps without taps"):
            check_flags(config, "torch")
    else:
        check_flags(config, "torch")
