# SPDX-License-Identifier: Apache-2.0
"""torch_backend/cpu_threads.py: the CPU path's thread count is the cores other processes leave free (issue 32, point
1; `make bench-contention` measures what it buys), and a user's OMP_NUM_THREADS is kept."""
import types

import torch

from models.tt_transformers.torch_backend import cpu_threads


def governed(monkeypatch, cores: int, samples: list, env: bool = False):
    """A CpuThreads on `cores` cores whose /proc/stat readings are `samples` (all processes' CPU seconds, this
    process's), one per reading, half a second apart."""
    readings, clock = iter(samples), iter([0.0, 0.6, 1.2, 1.8, 2.4])
    monkeypatch.setattr(cpu_threads, "available_cores", lambda: cores)
    monkeypatch.setattr(cpu_threads, "cpu_seconds", lambda: next(readings))
    monkeypatch.setattr(cpu_threads, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    if env:
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
    else:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    return cpu_threads.CpuThreads()


def test_threads_follow_other_processes_load(monkeypatch):
    before = torch.get_num_threads()
    try:
        # 4 cores; over each 0.6 s: others use 0.6 core-seconds (one core), then 1.2 (two), then none
        threads = governed(monkeypatch, 4, [(0.0, 0.0), (1.8, 1.2), (5.4, 3.6), (7.2, 5.4), (9.0, 7.2)])
        assert torch.get_num_threads() == 4
        threads.fit()
        assert torch.get_num_threads() == 3  # one other core busy
        threads.fit()
        assert torch.get_num_threads() == 2
        threads.fit()
        assert torch.get_num_threads() == 4  # quiet again
    finally:
        torch.set_num_threads(before)


def test_a_users_omp_num_threads_is_kept(monkeypatch):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        threads = governed(monkeypatch, 4, [(0.0, 0.0), (2.4, 0.0)], env=True)
        threads.fit()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
