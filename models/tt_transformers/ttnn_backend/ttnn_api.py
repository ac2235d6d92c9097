# SPDX-License-Identifier: Apache-2.0
"""tt-metal's ttnn, imported in one place. Every module of the backend does `from .ttnn_api import ttnn` at the top, as
tt-metal's own modules `import ttnn`; the module itself is looked up when an attribute is first read, so these modules
import on a machine without ttnn (the torch path, `make check-ttnn-api`, the tests' stand-in, which puts itself in
sys.modules["ttnn"] per test), and a machine without it gets one line naming the fix instead of a traceback from
whichever op ran first."""
import importlib

FIX = ("tt-metal's ttnn is not importable in this Python ({error}): run in tt-metal's python_env (tt-metal's "
       "create_venv.sh, then `source python_env/bin/activate`), or `pip install ttnn==0.81.1` on x86-64 Linux; "
       "without a Tenstorrent device, use the torch backend")


class TtnnMissing(ImportError):
    """ttnn could not be imported; the message names the fix."""


class Ttnn:
    """Stands for the ttnn module: `ttnn.X` is the module's X."""

    def __getattr__(self, name: str):
        try:
            module = importlib.import_module("ttnn")
        except ImportError as e:
            raise TtnnMissing(FIX.format(error=e)) from None
        return getattr(module, name)


ttnn = Ttnn()
