# SPDX-License-Identifier: Apache-2.0
"""Builds the C sources this package ships (the bf16 CPU kernels, the drafting extension) with the system C compiler
(`CC`, default `cc`) on first use, into the cache root (checkpoints/cache.py), keyed by the source, the compiler and
whatever else the build depends on: every later start loads the cached library."""
import hashlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import Optional

from loguru import logger


def build_library(source: Path, build_dir: Path, flags: list[str], libs: tuple[str, ...] = (), depends_on: str = "",
                  suffix: str = ".so", fallback: str = "") -> Optional[Path]:
    """The compiled `source` (cc <flags> -shared -fPIC <source> <libs>), built once into build_dir; None (with a
    warning that says what happens instead, `fallback`) when there is no compiler or the build fails. The build goes
    to a temporary file that is renamed into place, so a concurrent or interrupted build never leaves a half-written
    library."""
    cc = os.environ.get("CC", "cc")
    if not shutil.which(cc):
        logger.warning(f"no C compiler ({cc}; set CC) to build {source.name}: {fallback}")
        return None
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(source.read_bytes() + version.encode() + " ".join(flags).encode() + depends_on.encode())
    path = build_dir / f"{source.stem}-{key.hexdigest()[:16]}{suffix}"
    if not path.exists():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            logger.warning(f"cannot write {path.parent} ({e.strerror}; TT_CACHE_PATH={os.environ.get('TT_CACHE_PATH')}): "
                           f"{fallback}")
            return None
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        cmd = [cc, *flags, "-shared", "-fPIC", str(source), "-o", str(tmp), *libs]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            tmp.unlink(missing_ok=True)
            logger.warning(f"building {source.name} failed ({' '.join(cmd)}): {result.stderr.strip()}; {fallback}")
            return None
        tmp.replace(path)
    return path
