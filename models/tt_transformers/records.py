# SPDX-License-Identifier: Apache-2.0
"""What a run leaves behind: where it was measured (`environment`) and its JSON, written whole or not at all
(`ReportFile`, `write_json_atomic`)."""
import json
import os
import platform
import subprocess
from pathlib import Path

from .errors import UserError

PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the folder holding models/: the repository, or site-packages


def environment(device: str) -> dict:
    """Where a report was measured: machine, software and the code's git commit (None outside a git checkout)."""
    import torch

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=PACKAGE_ROOT, capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
    except OSError:
        commit = None
    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in (cpuinfo.read_text().splitlines() if cpuinfo.is_file() else [])
             if line.startswith("model name")]
    return {"machine": platform.machine(), "processor": names[0] if names else platform.processor(),
            "cpu_count": os.cpu_count(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "torch_threads": torch.get_num_threads(), "python": platform.python_version(), "torch": torch.__version__,
            "device": device, "git_commit": commit}


class ReportFile:
    """A JSON report file reserved before the run: its temporary file is created in the report's folder at once, so a
    path that cannot be written (a read-only folder, /proc) stops the run before it starts, whatever permission bits
    say; the report is written into that same file and renamed over the path only when whole. A run that fails or is
    interrupted calls discard(): nothing of it is left, not even the folders made for it."""

    def __init__(self, path, name: str = "report file"):
        self.path = Path(path).expanduser()
        if self.path.is_dir():
            raise UserError(f"{name} {str(path)!r} is a directory; give a file path")
        self.made: list[Path] = []  # folders created for the report, innermost last
        missing = [folder for folder in self.path.parents if not folder.exists()]
        self.tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        try:
            for folder in reversed(missing):
                folder.mkdir()
                self.made.append(folder)
            os.close(os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except OSError as e:
            self.discard()
            raise UserError(f"{name} {str(path)!r} cannot be written (creating a file in {self.path.parent} "
                            f"failed: {e.strerror}); pass a path in a folder you can write in") from None

    def write(self, data) -> None:
        try:
            self.tmp.write_text(json.dumps(data, indent=2))
            os.replace(self.tmp, self.path)
        except BaseException:  # a full disk: no half-written report either
            self.discard()
            raise

    def discard(self) -> None:
        if self.tmp.exists():  # not when creating it failed
            self.tmp.unlink()
        for folder in reversed(self.made):
            folder.rmdir()


def write_json_atomic(path, data, name: str = "output file") -> None:
    """JSON written whole or not at all (a reader never sees half a file)."""
    ReportFile(path, name).write(data)
