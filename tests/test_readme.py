# SPDX-License-Identifier: Apache-2.0
"""The README's example of the library used directly runs as written (on the embedded model), drafts as the demo does
by default (copied drafts or the shipped draft head), and what it generates is what plain decoding generates."""
import re

from models.tt_transformers.checkpoints.eagle3_format import DRAFT_HEADS, read_head_config
from models.tt_transformers.speculative import SpeculativeGenerator
from models.tt_transformers.speculative.drafters import HeadDrafter, HybridDrafter

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
    assert "apples" in printed and "IterationStats(draft_source=" in printed
    assert sum(it.accepted for it in result.iterations) > 0  # the list's copies were drafted and accepted
    drafter = namespace["generator"].drafter  # the demo's default: the hybrid with the head shipped for the model
    assert isinstance(drafter, HybridDrafter) and isinstance(drafter.fallback, HeadDrafter)
    shipped = DRAFT_HEADS / namespace["ckpt"].name
    assert drafter.fallback.head.head.config == read_head_config(shipped, target.model.args)
    plain = SpeculativeGenerator(target, None, 0, namespace["eos_token_ids"](namespace["ckpt"], namespace["tokenizer"]))
    assert result.output_tokens == plain.generate([prompt], 48)[0].output_tokens
