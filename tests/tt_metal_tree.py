# SPDX-License-Identifier: Apache-2.0
"""A fake tt-metal checkout (a TEST DOUBLE of its folder layout, not its code) and a Python run beside it: for the
tests that import our models.tt_transformers.* next to tt-metal's models.tt_transformers.tt."""
import os
import subprocess
import sys


def fake_tt_metal(root, regular: bool):
    """models/tt_transformers/{tt,demo}/ as in tt-metal, with or without (empty) __init__.py files."""
    for folder in ("models", "models/tt_transformers", "models/tt_transformers/tt", "models/tt_transformers/demo"):
        (root / folder).mkdir(parents=True)
        if regular:
            (root / folder / "__init__.py").write_text("")
    (root / "models/tt_transformers/tt/model.py").write_text("MARKER = 'tt-metal'\n")
    (root / "models/tt_transformers/demo/simple_text_demo.py").write_text("")
    return root


def run(args, pythonpath):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, pythonpath))}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd="/")
