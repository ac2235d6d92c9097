# SPDX-License-Identifier: Apache-2.0
"""The library (models/tt_transformers/speculative) on its own: importing it imports torch and nothing of a backend or
the demo, and builds nothing (the drafting extension is built when a drafter first needs it)."""
import json
import subprocess
import sys

from ..conftest import REPO_ROOT

PROBE = """
import json, sys
import models.tt_transformers.speculative as library
from models.tt_transformers.speculative.copy_sources import native
ours = sorted({m.split(".")[2] for m in sys.modules if m.startswith("models.tt_transformers.") and m.count(".") >= 2})
print(json.dumps({"ours": ours, "built": native.suffix_native.cache_info().currsize, "api": library.__all__}))
"""


def test_the_library_imports_no_backend_and_builds_nothing():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=REPO_ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    # cpu_caps: the package's __init__ sets a forced CPU path's caps there (no torch, no backend)
    assert set(found["ours"]) <= {"speculative", "errors", "native_build", "checkpoints", "cpu_caps"}, found["ours"]
    assert found["built"] == 0  # nothing compiled at import
    assert {"SpeculativeGenerator", "SpeculativeConfig", "make_drafter", "CausalLM", "Drafter"} <= set(found["api"])
