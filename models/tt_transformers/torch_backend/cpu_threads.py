# SPDX-License-Identifier: Apache-2.0
"""How many threads the CPU path runs: the cores other processes leave free, rechecked as a run goes.

torch and the bf16 CPU kernels share one OpenMP runtime (torch loads its libgomp.so.1 first and the kernels'
dependency on libgomp.so.1 resolves to it), so one thread count, torch.set_num_threads, governs both. Its default is
every core, and OpenMP threads spin at each barrier: beside one CPU-bound process on this project's 2-core VM plain
decoding of the embedded model went from 9.3 to 29.4 ms a token with 2 threads, 14.5 ms with 1
(`make bench-contention`, docs/results.md). So the count follows the load: the cores this process may use
(affinity, a cgroup quota), less those other processes kept busy over the last interval (/proc/stat against this
process's own CPU time). An OMP_NUM_THREADS the user set is left alone.
"""
import math
import os
import time
from pathlib import Path
from typing import Optional

import torch

INTERVAL_S = 0.5  # how often the load is looked at: a few dozen decode steps
BUSY_CORE = 0.25  # another process using more than this much of a core takes it


def cpu_seconds() -> Optional[tuple[float, float]]:
    """(CPU seconds every process has run, this process's), now: /proc/stat's busy time and os.times (None where
    there is no /proc/stat)."""
    stat = Path("/proc/stat")
    if not stat.is_file():
        return None
    fields = [int(v) for v in stat.read_text().split("\n", 1)[0].split()[1:]]
    busy = sum(fields) - fields[3] - fields[4]  # all but idle and iowait; steal counts: another guest ran
    times = os.times()
    return busy / os.sysconf("SC_CLK_TCK"), times.user + times.system


def available_cores() -> int:
    """The cores this process may run on: its CPU affinity, capped by a cgroup v2 CPU quota (a container's limit)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = Path("/sys/fs/cgroup/cpu.max")
    if quota.is_file():
        limit, period = (quota.read_text().split() + ["100000"])[:2]
        if limit != "max":
            cores = min(cores, max(1, math.floor(int(limit) / int(period))))
    return cores


class CpuThreads:
    """Keeps torch's thread count at the cores other processes leave free (module docstring); `fit` is called before
    each forward and looks at the load every INTERVAL_S."""

    def __init__(self):
        self.cores = available_cores()
        self.user_set = "OMP_NUM_THREADS" in os.environ
        self.last, self.at = cpu_seconds(), time.perf_counter()
        if not self.user_set and torch.get_num_threads() != self.cores:
            torch.set_num_threads(self.cores)

    def fit(self) -> None:
        now = time.perf_counter()
        if self.user_set or self.last is None or now - self.at < INTERVAL_S:
            return
        sample = cpu_seconds()
        others = max(0.0, sample[0] - self.last[0] - (sample[1] - self.last[1])) / (now - self.at)
        self.last, self.at = sample, now
        threads = max(1, self.cores - math.ceil(others - BUSY_CORE))
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)


_THREADS: Optional[CpuThreads] = None


def fit_threads() -> None:
    """The process's CpuThreads (made on first use) fitted to the load now."""
    global _THREADS
    if _THREADS is None:
        _THREADS = CpuThreads()
    _THREADS.fit()
