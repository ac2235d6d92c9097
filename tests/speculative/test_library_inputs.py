# SPDX-License-Identifier: Apache-2.0
"""The library called as a TT engineer would, mistakes included: every entry point (SpeculativeConfig,
SamplingParams, SpeculativeGenerator and its generate, make_drafter, the loaders, TorchCausalLM) refuses a wrong
type, a value out of range, a falsy value that would be taken as a default, or a model or head that does not fit the
target with one UserError line naming the parameter, before any work: a refused call changes nothing. And what a run
reports: why each answer ended (finish_reason), and acceptance counted up to an EOS, never past it."""
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from models.tt_transformers.checkpoints.checkpoint import load_tokenizer, resolve_checkpoint
from models.tt_transformers.errors import UserError
from models.tt_transformers.speculative import (
    SamplingParams,
    SpeculativeConfig,
    SpeculativeGenerator,
    make_drafter,
    summarize,
)
from models.tt_transformers.speculative.drafters import Draft
from models.tt_transformers.speculative.results import FINISH_REASONS
from models.tt_transformers.torch_backend.causal_lm import TorchCausalLM
from models.tt_transformers.torch_backend.load import load_model

from ..conftest import random_model, save_tiny_hf_checkpoint

VOCAB, LAYERS, MAX_SEQ_LEN = 64, 3, 64  # random_model's
PROMPT = [1, 5, 9, 13, 2, 7]
N_TOKENS = 12


@pytest.fixture(scope="module")
def model():
    return random_model()


@pytest.fixture(scope="module")
def plain(model):
    """Plain greedy decoding of PROMPT: what every generator must still give after a refused call."""
    return SpeculativeGenerator(TorchCausalLM(model, LAYERS, 1), None, 0).generate([PROMPT], N_TOKENS)[0]


class CountingTarget(TorchCausalLM):
    """The target with its prefills and steps counted: a refused call must not have run any."""

    def __init__(self, *args):
        super().__init__(*args)
        self.calls = 0

    def prefill(self, *args, **kwargs):
        self.calls += 1
        return super().prefill(*args, **kwargs)

    def step(self, *args, **kwargs):
        self.calls += 1
        return super().step(*args, **kwargs)


@pytest.fixture
def env(model):
    target = CountingTarget(model, LAYERS, 1)
    drafter = make_drafter(SpeculativeConfig(draft_mode="suffix"), target)
    return SimpleNamespace(model=model, target=target, drafter=drafter,
                           generator=SpeculativeGenerator(target, drafter, 4))


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A small Llama checkpoint written by transformers, with the embedded model's tokenizer files beside it."""
    folder = tmp_path_factory.mktemp("tiny")
    save_tiny_hf_checkpoint(folder, tie_word_embeddings=True)
    return resolve_checkpoint(str(folder))


class OwnTarget:
    """A CausalLM of an engineer's own, written to the protocol before it had draft_head: the target's members, and
    no draft_head."""

    def __init__(self, lm):
        self.lm = lm

    def __getattr__(self, name):
        if name == "draft_head":
            raise AttributeError(name)
        return getattr(self.lm, name)


def other_vocab_lm():
    return TorchCausalLM(random_model(vocab_size=VOCAB * 2), 2, 1)


def gen(e, **kwargs):
    args = dict(target=e.target, drafter=e.drafter, n_draft_tokens=4)
    args.update(kwargs)
    return SpeculativeGenerator(**args)


# (id, the call, the parameter its one line must name)
CASES = [
    # SpeculativeConfig: wrong types, out of range, a falsy value that was taken for the default
    ("config-n_draft_tokens-str", lambda e: SpeculativeConfig(n_draft_tokens="4"), "n_draft_tokens"),
    ("config-n_draft_tokens-float", lambda e: SpeculativeConfig(n_draft_tokens=4.0), "n_draft_tokens"),
    ("config-n_draft_tokens-bool", lambda e: SpeculativeConfig(n_draft_tokens=True), "n_draft_tokens"),
    ("config-n_draft_tokens-65", lambda e: SpeculativeConfig(n_draft_tokens=65), "n_draft_tokens"),
    ("config-n_draft_tokens-negative", lambda e: SpeculativeConfig(n_draft_tokens=-1), "n_draft_tokens"),
    ("config-draft_mode-case", lambda e: SpeculativeConfig(draft_mode="Suffix"), "draft_mode"),
    ("config-draft_mode-None", lambda e: SpeculativeConfig(draft_mode=None), "draft_mode"),
    ("config-sa_threshold-0", lambda e: SpeculativeConfig(sa_threshold=0), "sa_threshold"),
    ("config-sa_threshold-float", lambda e: SpeculativeConfig(sa_threshold=1.5), "sa_threshold"),
    ("config-draft_memory-negative", lambda e: SpeculativeConfig(draft_memory=-1), "draft_memory"),
    ("config-draft_memory-str", lambda e: SpeculativeConfig(draft_memory="64k"), "draft_memory"),
    ("config-recycle_top_k-33", lambda e: SpeculativeConfig(recycle_top_k=33), "recycle_top_k"),
    ("config-recycle_top_k-None", lambda e: SpeculativeConfig(recycle_top_k=None), "recycle_top_k"),
    ("config-trees-no", lambda e: SpeculativeConfig(trees="no"), "trees"),
    ("config-trees-None", lambda e: SpeculativeConfig(trees=None), "trees"),
    ("config-draft_layers-0", lambda e: SpeculativeConfig(draft_mode="model", draft_layers=0), "draft_layers"),
    ("config-draft_layers-float", lambda e: SpeculativeConfig(draft_mode="model", draft_layers=2.5), "draft_layers"),
    # SamplingParams
    ("sampling-temperature-str", lambda e: SamplingParams(temperature="0.7"), "temperature"),
    ("sampling-temperature-negative", lambda e: SamplingParams(temperature=-0.1), "temperature"),
    ("sampling-temperature-nan", lambda e: SamplingParams(temperature=float("nan")), "temperature"),
    ("sampling-temperature-bool", lambda e: SamplingParams(temperature=True), "temperature"),
    ("sampling-top_k-greedy", lambda e: SamplingParams(top_k=50), "top_k"),
    ("sampling-top_p-greedy", lambda e: SamplingParams(top_p=0.9), "top_p"),
    ("sampling-top_k-float", lambda e: SamplingParams(temperature=0.7, top_k=2.5), "top_k"),
    ("sampling-top_k-negative", lambda e: SamplingParams(temperature=0.7, top_k=-1), "top_k"),
    ("sampling-top_p-0", lambda e: SamplingParams(temperature=0.7, top_p=0), "top_p"),
    ("sampling-top_p-percent", lambda e: SamplingParams(temperature=0.7, top_p=90), "top_p"),
    ("sampling-seed-str", lambda e: SamplingParams(temperature=0.7, seed="abc"), "seed"),
    ("sampling-seed-negative", lambda e: SamplingParams(temperature=0.7, seed=-1), "seed"),
    ("sampling-seed-float", lambda e: SamplingParams(temperature=0.7, seed=1.5), "seed"),
    # SpeculativeGenerator
    ("generator-target-raw-model", lambda e: gen(e, target=e.model), "target"),
    ("generator-no-drafter", lambda e: gen(e, drafter=None), "drafter"),
    ("generator-drafter-is-config", lambda e: gen(e, drafter=SpeculativeConfig()), "drafter"),
    ("generator-n_draft_tokens-str", lambda e: gen(e, n_draft_tokens="4"), "n_draft_tokens"),
    ("generator-eos-int", lambda e: gen(e, eos_token_ids=2), "eos_token_ids"),
    ("generator-eos-outside-vocab", lambda e: gen(e, eos_token_ids=[VOCAB]), "eos_token_ids"),
    ("generator-eos-None", lambda e: gen(e, eos_token_ids=[None]), "eos_token_ids"),
    ("generator-sampling-dict", lambda e: gen(e, sampling_params={"temperature": 0.7}), "sampling_params"),
    ("generator-log_iterations-negative", lambda e: gen(e, log_iterations=-1), "log_iterations"),
    ("generator-trees-str", lambda e: gen(e, trees="no"), "trees"),
    # generate: after each, the generator still decodes plainly (checked in the test)
    ("generate-one-prompt", lambda e: e.generator.generate(PROMPT, N_TOKENS), "prompts"),
    ("generate-text", lambda e: e.generator.generate("Hello", N_TOKENS), "prompts"),
    ("generate-texts", lambda e: e.generator.generate(["Hello"], N_TOKENS), "prompts"),
    ("generate-no-prompts", lambda e: e.generator.generate([], N_TOKENS), "prompts"),
    ("generate-empty-prompt", lambda e: e.generator.generate([[]], N_TOKENS), "prompts"),
    ("generate-id-outside-vocab", lambda e: e.generator.generate([[1, 2, VOCAB]], N_TOKENS), "prompts"),
    ("generate-negative-id", lambda e: e.generator.generate([[1, -1]], N_TOKENS), "prompts"),
    ("generate-float-ids", lambda e: e.generator.generate([[1.0, 2.0]], N_TOKENS), "prompts"),
    ("generate-too-many-prompts", lambda e: e.generator.generate([PROMPT, PROMPT], N_TOKENS), "max_batch_size"),
    ("generate-prompt-fills-cache", lambda e: e.generator.generate([[1] * MAX_SEQ_LEN], N_TOKENS), "max_seq_len"),
    ("generate-max_generated_tokens-float", lambda e: e.generator.generate([PROMPT], 8.5), "max_generated_tokens"),
    ("generate-max_generated_tokens-0", lambda e: e.generator.generate([PROMPT], 0), "max_generated_tokens"),
    ("generate-max_generated_tokens-str", lambda e: e.generator.generate([PROMPT], "8"), "max_generated_tokens"),
    ("generate-stop_at_eos-str", lambda e: e.generator.generate([PROMPT], 8, stop_at_eos="no"), "stop_at_eos"),
    ("generate-requests-count", lambda e: e.generator.generate([PROMPT], 8, requests=[0, 1]), "requests"),
    ("generate-requests-negative", lambda e: e.generator.generate([PROMPT], 8, requests=[-1]), "requests"),
    ("generate-requests-str", lambda e: e.generator.generate([PROMPT], 8, requests=["a"]), "requests"),
    # make_drafter: its arguments, and models or heads that do not fit the target
    ("drafter-config-dict", lambda e: make_drafter({"draft_mode": "suffix"}, e.target), "config"),
    ("drafter-config-changed", lambda e: make_drafter(changed(SpeculativeConfig(), trees="no"), e.target), "trees"),
    ("drafter-target-raw-model", lambda e: make_drafter(SpeculativeConfig(), e.model), "target"),
    ("drafter-target-builds-no-head", lambda e: make_drafter(SpeculativeConfig(), OwnTarget(e.target)), "target"),
    ("drafter-head-mode-target-builds-no-head", lambda e: make_drafter(SpeculativeConfig(draft_mode="head"),
                                                                       OwnTarget(e.target)), "target"),
    ("drafter-draft_layers-whole-target", lambda e: make_drafter(
        SpeculativeConfig(draft_mode="model", draft_layers=LAYERS), e.target), "draft_layers"),
    ("drafter-draft_lm-vocab", lambda e: make_drafter(SpeculativeConfig(draft_mode="model"), e.target,
                                                      draft_lm=other_vocab_lm()), "draft_lm"),
    ("drafter-draft_lm-batch", lambda e: make_drafter(SpeculativeConfig(draft_mode="model"),
                                                      TorchCausalLM(e.model, LAYERS, 2),
                                                      draft_lm=TorchCausalLM(e.model, 1, 1)), "draft_lm"),
    ("drafter-draft_lm-context", lambda e: make_drafter(SpeculativeConfig(draft_mode="model"), e.target,
                                                        draft_lm=TorchCausalLM(random_model(max_seq_len=16), 1, 1)),
     "draft_lm"),
    ("drafter-draft_lm-raw-model", lambda e: make_drafter(SpeculativeConfig(draft_mode="model"), e.target,
                                                          draft_lm=e.model), "draft_lm"),
    ("drafter-draft_cost-0", lambda e: make_drafter(SpeculativeConfig(), e.target, draft_cost=0), "draft_cost"),
    ("drafter-draft_cost-str", lambda e: make_drafter(SpeculativeConfig(), e.target, draft_cost="low"), "draft_cost"),
    ("drafter-documents-text", lambda e: make_drafter(SpeculativeConfig(), e.target, documents="some text"),
     "documents"),
    ("drafter-documents-one", lambda e: make_drafter(SpeculativeConfig(), e.target, documents=[1, 2, 3]),
     "documents"),
    ("drafter-documents-vocab", lambda e: make_drafter(SpeculativeConfig(), e.target, documents=[[1, VOCAB]]),
     "documents"),
    ("drafter-head-vocab", lambda e: make_drafter(SpeculativeConfig(draft_mode="head"), e.target,
                                                  head=SimpleNamespace(vocab_size=VOCAB * 2, taps=(0, 1))), "head"),
    ("drafter-head-taps", lambda e: make_drafter(SpeculativeConfig(draft_mode="head"), e.target,
                                                 head=SimpleNamespace(vocab_size=VOCAB, taps=(0, LAYERS + 1))),
     "head"),
    ("drafter-two-heads", lambda e: make_drafter(SpeculativeConfig(draft_mode="head"), e.target,
                                                 head=SimpleNamespace(vocab_size=VOCAB, taps=(0,)),
                                                 device_head=SimpleNamespace(vocab_size=VOCAB, taps=(0,))),
     "device_head"),
    # TorchCausalLM's constructor
    ("causal_lm-n_layers-0", lambda e: TorchCausalLM(e.model, 0, 1), "n_layers"),
    ("causal_lm-n_layers-too-many", lambda e: TorchCausalLM(e.model, LAYERS + 1, 1), "n_layers"),
    ("causal_lm-n_layers-bool", lambda e: TorchCausalLM(e.model, True, 1), "n_layers"),
    ("causal_lm-max_batch_size-0", lambda e: TorchCausalLM(e.model, LAYERS, 0), "max_batch_size"),
    ("causal_lm-max_batch_size-float", lambda e: TorchCausalLM(e.model, LAYERS, 2.0), "max_batch_size"),
    ("causal_lm-model-state_dict", lambda e: TorchCausalLM(e.model.state_dict(), LAYERS, 1), "model"),
]


def changed(config: SpeculativeConfig, **fields) -> SpeculativeConfig:
    """A config whose fields were set after it was built (the dataclass is not frozen)."""
    for name, value in fields.items():
        setattr(config, name, value)
    return config


def assert_one_line_naming(error: UserError, parameter: str) -> None:
    message = str(error)
    assert "\n" not in message and parameter in message, message
    assert error.parameter is None or parameter.startswith(error.parameter) or error.parameter in message, message


@pytest.mark.parametrize("case,call,parameter", CASES, ids=[c[0] for c in CASES])
def test_a_mistake_is_one_line_naming_the_parameter_and_changes_nothing(env, plain, case, call, parameter):
    """Each mistake is refused with one UserError line naming the parameter, before the target ran anything; the
    generator it was made on then decodes exactly as plain decoding does."""
    with pytest.raises(UserError) as error:
        call(env)
    assert_one_line_naming(error.value, parameter)
    assert env.target.calls == 0, "the refused call ran the target"
    assert env.generator.generate([PROMPT], N_TOKENS)[0].output_tokens == plain.output_tokens


def test_there_are_many_mistakes():
    assert len(CASES) >= 40 and len({c[0] for c in CASES}) == len(CASES)


def test_what_the_checks_take(model):
    """What is right passes, in the forms a caller has at hand: numpy and 0-d torch integers, a 2-d tensor of
    prompts, a Path for a checkpoint; draft_layers is honoured as given."""
    import numpy as np

    target = TorchCausalLM(model, LAYERS, 2)
    prompts = torch.tensor([PROMPT, PROMPT[::-1]])
    results = SpeculativeGenerator(target, None, 0, [np.int64(3)]).generate(prompts, np.int32(4))
    assert [r.prompt_tokens for r in results] == [PROMPT, PROMPT[::-1]]
    drafter = make_drafter(SpeculativeConfig(draft_mode="model", draft_layers=1), target)
    assert drafter.lm.n_layers == 1
    params = SamplingParams(temperature=np.float32(0.5), top_k=torch.tensor(5), seed=np.uint64(2**63))
    assert (params.temperature, params.top_k, params.seed) == (0.5, 5, 2**63)
    assert all(type(v) in (int, float) for v in (params.temperature, params.top_k, params.top_p, params.seed))
    assert SamplingParams(seed=3).seed == 3  # a seed is harmless under greedy: a script may always pass one


LOADER_CASES = [
    ("resolve-int", lambda c: resolve_checkpoint(42), "HF_MODEL/--model"),
    ("tokenizer-str", lambda c: load_tokenizer(str(c.folder)), "ckpt"),
    ("load-str", lambda c: load_model(str(c.folder), torch.float32, 64), "ckpt"),
    ("load-dtype-str", lambda c: load_model(c, "bfloat16", 64), "dtype"),
    ("load-dtype-int8", lambda c: load_model(c, torch.int8, 64), "dtype"),
    ("load-max_seq_len-float", lambda c: load_model(c, torch.float32, 64.0), "max_seq_len"),
    ("load-max_seq_len-1", lambda c: load_model(c, torch.float32, 1), "max_seq_len"),
    ("load-device", lambda c: load_model(c, torch.float32, 64, device="tpu"), "device"),
    ("load-cpu_kernels-path", lambda c: load_model(c, torch.bfloat16, 64, cpu_kernels="avx3"), "cpu_kernels"),
    ("load-cpu_kernels-str", lambda c: load_model(c, torch.bfloat16, 64, cpu_kernels="no"), "cpu_kernels"),
    ("load-n_layers", lambda c: load_model(c, torch.float32, 64, n_layers=99), "n_layers"),
]


@pytest.mark.parametrize("case,call,parameter", LOADER_CASES, ids=[c[0] for c in LOADER_CASES])
def test_loader_mistakes_are_one_line(tiny_checkpoint, case, call, parameter):
    with pytest.raises(UserError) as error:
        call(tiny_checkpoint)
    assert_one_line_naming(error.value, parameter)


def test_a_checkpoint_is_found_from_a_path(tiny_checkpoint):
    assert resolve_checkpoint(Path(tiny_checkpoint.folder)).folder == tiny_checkpoint.folder


@pytest.mark.parametrize("config_vocab", [120, 130])
def test_config_vocab_size_that_disagrees_with_the_weights_is_named_at_load(tiny_checkpoint, tmp_path, config_vocab):
    """config.json's vocab_size against the 128-row tied embedding: named at load, with the file and both numbers
    (on the bf16 CPU kernels the LM head is packed from the file as it is, so the model loaded, then failed in a
    kernel)."""
    folder = tmp_path / "edited"
    shutil.copytree(tiny_checkpoint.folder, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": config_vocab}))
    with pytest.raises(UserError) as error:
        load_model(resolve_checkpoint(str(folder)), torch.bfloat16, 64)
    message = str(error.value)
    assert "\n" not in message and str(folder / "config.json") in message, message
    assert f"vocab_size {config_vocab}" in message and "[128, 64]" in message, message


# ---- what a run reports ----


def test_finish_reason_says_why_each_answer_ended(model, plain):
    """"stop" at an EOS, "length" at max_generated_tokens, "cache_end" where the KV cache ended first (fewer tokens
    than asked for, and no EOS)."""
    target = TorchCausalLM(model, LAYERS, 1)
    assert plain.finish_reason == "length" and len(plain.output_tokens) == N_TOKENS
    eos = plain.output_tokens[4]
    stopped = SpeculativeGenerator(target, None, 0, [eos]).generate([PROMPT], N_TOKENS)[0]
    assert stopped.finish_reason == "stop" and stopped.output_tokens[-1] == eos
    long_prompt = (PROMPT * 10)[: MAX_SEQ_LEN - 5]
    for n_draft, drafter in ((0, None), (4, make_drafter(SpeculativeConfig(draft_mode="suffix"), target))):
        cut = SpeculativeGenerator(target, drafter, n_draft).generate([long_prompt], 20)[0]
        assert cut.finish_reason == "cache_end" and len(cut.prompt_tokens) + len(cut.output_tokens) == MAX_SEQ_LEN
    assert set(FINISH_REASONS) == {"stop", "length", "cache_end"}


class OracleDrafter:
    """Drafts exactly what plain decoding will say next (its tokens given), so every draft is accepted: an EOS
    inside a draft then has accepted drafts after it."""

    top_k, taps = 0, ()

    def __init__(self, text: list[int]):
        self.text = text

    def start(self, users, prompts, sampler, hidden=None):
        pass

    def propose(self, users, contexts, max_tokens, extra_cost, trees=False):
        return [Draft(self.text[len(ctx): len(ctx) + n], "suffix") for ctx, n in zip(contexts, max_tokens)]

    def accept(self, user, verified):
        pass


def test_drafts_past_an_eos_are_neither_accepted_nor_counted(model, plain):
    """An EOS mid-draft: the answer stops at it, and the drafts verified after it are not counted as accepted, so
    acceptance never claims more tokens than the answer has (the issue: mean acceptance length 4.25 beside 3.75
    tokens per target forward)."""
    eos = plain.output_tokens[3]
    assert eos not in plain.output_tokens[:3]
    text = PROMPT + plain.output_tokens
    target = TorchCausalLM(model, LAYERS, 1)
    result = SpeculativeGenerator(target, OracleDrafter(text), 8, [eos]).generate([PROMPT], N_TOKENS)[0]
    assert result.output_tokens == plain.output_tokens[:4] and result.finish_reason == "stop"
    (iteration,) = result.iterations  # one draft of 8 from the first token: the EOS is its third token
    assert iteration.drafted == 8 and iteration.accepted == 3  # up to and with the EOS, not the 5 after it
    counters = summarize([[result]], 8)["spec_decode"]
    assert counters["vllm:spec_decode_num_accepted_tokens_total"] <= len(result.output_tokens) - 1
