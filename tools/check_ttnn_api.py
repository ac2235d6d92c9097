# SPDX-License-Identifier: Apache-2.0
"""Check every ttnn name the ttnn backend uses against the installed ttnn wheel (`make check-ttnn-api`, which
installs ttnn==0.81.1 in a Python 3.12 venv: ttnn ships cp310/cp312 wheels only).

Reads our sources with `ast` (nothing of ours is imported, so the venv needs no torch) and, for every
`ttnn.<module>.<name>` they reference and every call `ttnn.X(..., keyword=...)` they make (plus the calls made
through a variable, INDIRECT_CALLS, and the methods called on ttnn objects, METHOD_CALLS, below), checks that the attribute exists in the wheel and that each keyword is
named in the op's docstring. A keyword the docstring does not name is accepted only if the wheel's binary signature
(nanobind) lists it, and the report says so. Exit status 1 on any failure.
"""
import ast
import importlib.metadata
import inspect
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# the backend, and what runs beside it on a device: the pytest fixture, TT's own decode as the perf test's baseline
SOURCES = sorted((REPO / "models/tt_transformers/ttnn_backend").glob("*.py")) + [REPO / "conftest.py",
                                                                                 REPO / "tests/tt_baseline.py"]
# Calls the backend makes through a variable holding a ttnn op (attention.py's ordered_update and grouped_attention
# wrap the ops).
INDIRECT_CALLS = {"experimental.paged_update_cache": {"update_idxs_tensor"},
                  "transformer.paged_scaled_dot_product_attention_decode": {
                      "page_table_tensor", "cur_pos_tensor", "sliding_window_size", "memory_config",
                      "spec_multi_pos_tiles"}}
# Methods the backend calls on ttnn objects it holds (taps.py dram_copy: x.memory_config().is_sharded();
# traces.py program_cache_entries: mesh.num_program_cache_entries(), looked up with getattr).
METHOD_CALLS = {"Tensor.memory_config": set(), "MemoryConfig.is_sharded": set(),
                "MeshDevice.num_program_cache_entries": set()}


def ttnn_path(node):
    """'experimental.paged_update_cache' for the expression ttnn.experimental.paged_update_cache, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id == "ttnn" and parts:
        return ".".join(reversed(parts))
    return None


def uses(paths):
    """{ttnn path: set of keywords passed to it} over the sources."""
    found = {name: set(kws) for name, kws in {**INDIRECT_CALLS, **METHOD_CALLS}.items()}
    for path in paths:
        tree = ast.parse(path.read_text(), str(path))
        inner = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and ttnn_path(node):
                inner.add(id(node.value))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and id(node) not in inner and ttnn_path(node):
                found.setdefault(ttnn_path(node), set())
            if isinstance(node, ast.Call) and ttnn_path(node.func):
                found.setdefault(ttnn_path(node.func), set()).update(k.arg for k in node.keywords if k.arg)
    return found


def signature_text(obj) -> str:
    """What the wheel's binary says the op accepts: a nanobind signature, a Python signature, or the argument
    error a registered op raises when called with nothing (it parses arguments before running anything)."""
    texts = [str(s[0]) for s in getattr(obj, "__nb_signature__", ())]
    if isinstance(obj, type):  # a bound class (ttnn.CoreGrid): its constructor's signature
        texts += [str(s[0]) for s in getattr(obj.__init__, "__nb_signature__", ())]
    function = getattr(obj, "function", None)
    texts += [str(s[0]) for s in getattr(function, "__nb_signature__", ())]
    if not texts:
        try:
            params = inspect.signature(obj).parameters.values()
            if any(p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):  # not a (*args, **kwargs) wrapper
                texts.append(str(inspect.signature(obj)))
        except (TypeError, ValueError):
            pass
    if not texts and function is not None:  # a registered C++ op: its argument error lists the signatures
        try:
            function()
        except TypeError as error:
            texts.append(str(error))
    return "\n".join(texts)


def main() -> int:
    import ttnn

    failures, rows = 0, []
    for path, keywords in sorted(uses(SOURCES).items()):
        obj = ttnn
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            rows.append((f"ttnn.{path}", "MISSING from the wheel"))
            failures += 1
            continue
        doc = (getattr(obj, "__doc__", None) or "") + (getattr(getattr(obj, "function", None), "__doc__", None) or "")
        notes = []
        for kw in sorted(keywords):
            if re.search(rf"\b{kw}\b", doc):
                notes.append(f"{kw}: docstring")
            elif re.search(rf"\b{kw}\b", signature_text(obj)):
                notes.append(f"{kw}: not in the docstring, in the binary signature")
            else:
                notes.append(f"{kw}: NOT ACCEPTED")
                failures += 1
        rows.append((f"ttnn.{path}", "; ".join(notes) or "exists"))
    print(f"ttnn {importlib.metadata.version('ttnn')} from {Path(ttnn.__file__).parent}; sources: "
          + ", ".join(str(p.relative_to(REPO)) for p in SOURCES))
    for name, status in rows:
        print(f"  {name:50} {status}")
    print(f"{len(rows)} names, {failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
