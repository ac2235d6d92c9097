# SPDX-License-Identifier: Apache-2.0
"""Installed beside a tt-metal checkout: our models.tt_transformers.* and tt-metal's models.tt_transformers.tt import
side by side (a fake tt-metal tree stands in for the checkout), from this checkout or from the wheel pip installs, in
either order on the path; the wheel ships no models/__init__.py; and the torch path never imports ttnn."""
import shutil
import subprocess
import sys
import zipfile

import pytest

from ..conftest import REPO_ROOT
from ..tt_metal_tree import fake_tt_metal, run

DEMO = REPO_ROOT / "models/tt_transformers/demo/speculative_decoding/speculative_demo.py"
PROBE = ("import models.tt_transformers.tt.model as tt, models.tt_transformers.demo.speculative_decoding.speculative_demo, "
         "models.tt_transformers.demo.speculative_decoding.options as ours; print(tt.MARKER, ours.DEFAULT_PROMPTS.name)")


@pytest.mark.parametrize("regular", [False, True], ids=["namespace-packages", "regular-packages"])
def test_imports_beside_tt_metal(tmp_path, regular):
    """tt-metal's folders are namespace packages (no models/__init__.py): either order imports both. A tree whose
    folders are regular packages (another project's) owns the name `models` wherever it comes first, before this
    checkout can run a line: there this checkout must come first (README, "Next to tt-metal")."""
    tt_metal = fake_tt_metal(tmp_path / "tt-metal", regular)
    out = run(["-c", PROBE], [REPO_ROOT, tt_metal])  # this repository first on PYTHONPATH
    assert out.returncode == 0 and out.stdout.split() == ["tt-metal", "sample_prompts.json"], out.stderr
    # Run by path with only tt-metal on PYTHONPATH (as from a tt-metal checkout): the demo puts itself first.
    out = run([str(DEMO), "--help"], [tt_metal])
    assert out.returncode == 0 and "--n_draft_tokens" in out.stdout, out.stderr
    out = run(["-c", PROBE], [tt_metal, REPO_ROOT])  # tt-metal first
    if regular:
        assert "No module named 'models.tt_transformers.demo.speculative_decoding'" in out.stderr
    else:
        assert out.returncode == 0 and out.stdout.split() == ["tt-metal", "sample_prompts.json"], out.stderr


WHEEL_PROBE = ("import models.tt_transformers.tt.model as tt, models.tt_transformers.errors as ours; "
               "print(tt.MARKER, ours.__file__)")


@pytest.fixture
def source(tmp_path):
    """What pip builds from: this checkout's package, pyproject.toml and README (copied: pip builds in the tree)."""
    pytest.importorskip("setuptools", reason="building here needs setuptools (pip --no-build-isolation)")
    source = tmp_path / "source"
    shutil.copytree(REPO_ROOT / "models", source / "models", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, source / name)
    return source


def test_the_wheel_ships_no_models_init_and_imports_beside_tt_metal_in_either_order(tmp_path, source):
    """pip's wheel leaves `models` a namespace package: it can neither replace another distribution's
    models/__init__.py nor be replaced by it (installed into the same folder, both import), and it merges with
    tt-metal's folders in either order."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "wheel"), str(source)], check=True, capture_output=True)
    (wheel,) = (tmp_path / "wheel").glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        z.extractall(tmp_path / "site")
    assert "models/__init__.py" not in names and "models/tt_transformers/speculative/__init__.py" in names
    site, tt_metal = tmp_path / "site", fake_tt_metal(tmp_path / "tt-metal", regular=False)
    for path in ([site, tt_metal], [tt_metal, site]):
        out = run(["-c", WHEEL_PROBE], path)
        assert out.returncode == 0 and out.stdout.split() == [
            "tt-metal", str(site / "models/tt_transformers/errors.py")], out.stderr
    (site / "models/__init__.py").write_text("")  # another distribution's, installed into the same folder
    out = run(["-c", "import models.tt_transformers.errors as ours; print(ours.__file__)"], [site])
    assert out.returncode == 0 and out.stdout.strip() == str(site / "models/tt_transformers/errors.py"), out.stderr


def test_an_editable_install_imports_behind_tt_metal(tmp_path, source):
    """`pip install -e .` and only tt-metal on PYTHONPATH (TT's own set-up, run from elsewhere): tt-metal's namespace
    `models` comes first, and setuptools' editable finder still reaches ours (it maps models.tt_transformers, not
    `models`, which it once mapped and then could not reach behind tt-metal's)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (site,) = venv.glob("lib/python*/site-packages")
    (site / "this_suite.pth").write_text(next(p for p in sys.path if p.endswith("site-packages")) + "\n")  # pip
    subprocess.run([venv / "bin/python", "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e",
                    str(source)], check=True, capture_output=True)
    tt_metal = fake_tt_metal(tmp_path / "tt-metal", regular=False)
    out = subprocess.run([venv / "bin/python", "-c", WHEEL_PROBE], capture_output=True, text=True, cwd="/",
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tt_metal)})
    assert out.returncode == 0 and out.stdout.split() == [
        "tt-metal", str(source / "models/tt_transformers/errors.py")], out.stderr


def test_torch_path_never_imports_ttnn():
    out = run(["-c", "import sys; from models.tt_transformers.demo.speculative_decoding import build, inputs, options; "
                     "config = options.DemoConfig(backend='torch', max_generated_tokens=2); "
                     "build.build(config, inputs.check_inputs(config)); print('ttnn' in sys.modules)"],
              [REPO_ROOT])
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "False", out.stderr[-2000:]
