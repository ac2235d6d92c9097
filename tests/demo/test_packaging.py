# SPDX-License-Identifier: Apache-2.0
"""Installed beside a tt-metal checkout: our models.tt_transformers.* and tt-metal's models.tt_transformers.tt import
side by side whether tt-metal's folders are regular or namespace packages (a fake tt-metal tree stands in for the
checkout), and the torch path never imports ttnn."""
import pytest

from ..conftest import REPO_ROOT
from ..tt_metal_tree import fake_tt_metal, run

DEMO = REPO_ROOT / "models/tt_transformers/demo/speculative_decoding/speculative_demo.py"
PROBE = ("import models.tt_transformers.tt.model as tt, models.tt_transformers.demo.speculative_decoding.speculative_demo, "
         "models.tt_transformers.demo.speculative_decoding.options as ours; print(tt.MARKER, ours.DEFAULT_PROMPTS.name)")


@pytest.mark.parametrize("regular", [True, False], ids=["regular-packages", "namespace-packages"])
def test_imports_beside_tt_metal(tmp_path, regular):
    tt_metal = fake_tt_metal(tmp_path / "tt-metal", regular)
    out = run(["-c", PROBE], [REPO_ROOT, tt_metal])  # this repository first on PYTHONPATH
    assert out.returncode == 0 and out.stdout.split() == ["tt-metal", "sample_prompts.json"], out.stderr
    # Run by path with only tt-metal on PYTHONPATH (as from a tt-metal checkout): the demo puts itself first.
    out = run([str(DEMO), "--help"], [tt_metal])
    assert out.returncode == 0 and "--n_draft_tokens" in out.stdout, out.stderr
    if not regular:  # namespace folders merge in any order
        out = run(["-c", PROBE], [tt_metal, REPO_ROOT])
        assert out.returncode == 0, out.stderr


def test_torch_path_never_imports_ttnn():
    out = run(["-c", "import sys; from models.tt_transformers.demo.speculative_decoding import build, inputs, options; "
                     "config = options.DemoConfig(backend='torch', max_generated_tokens=2); "
                     "build.build(config, inputs.check_inputs(config)); print('ttnn' in sys.modules)"],
              [REPO_ROOT])
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "False", out.stderr[-2000:]
