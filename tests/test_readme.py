# SPDX-License-Identifier: Apache-2.0
"""The README's example of the library used directly runs as written (on the embedded model), drafts in head mode with
the shipped draft head through the public names alone, and what it generates is what plain decoding generates."""
import re

from models.tt_transformers.checkpoints.eagle3_format import DRAFT_HEADS, read_head_config
from models.tt_transformers.speculative import SpeculativeGenerator
from models.tt_transformers.speculative.drafters import HeadDrafter

from .conftest import REPO_ROOT


def readme_example() -> str:
    """The python block of the README's section "The library, directly"."""
    section = (REPO_ROOT / "README.md").read_text().split("## The library, directly", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.S)
    return code


def test_the_readme_example_runs_and_is_lossless(capsys):
    namespace = {}
    exec(compile(readme_example(), "README.md", "exec"), namespace)
    printed = capsys.readouterr().out
    result, target, prompt = namespace["result"], namespace["target"], namespace["prompt"]
    per_forward = len(result.output_tokens) / len(result.iterations)  # the answer's (its first step: one draft)
    assert "apples" in printed and f"{per_forward:.2f} tokens per target forward" in printed
    # the head drafted (whether its drafts pay on this CPU is the policy's call: README's draft-mode table)
    assert sum(it.drafted for it in result.iterations if it.draft_source == "head") > 0
    drafter = namespace["generator"].drafter  # head mode: the head shipped for the model, from the config alone
    assert isinstance(drafter, HeadDrafter)
    shipped = DRAFT_HEADS / namespace["ckpt"].name
    assert drafter.head.head.config == read_head_config(shipped, target.model.args)
    plain = SpeculativeGenerator(target, None, 0, namespace["eos_token_ids"](namespace["ckpt"], namespace["tokenizer"]))
    assert result.output_tokens == plain.generate([prompt], 48)[0].output_tokens
