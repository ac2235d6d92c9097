# SPDX-License-Identifier: Apache-2.0
"""The demo's report: TT-Transformers' performance block, the per-prompt table and the --output_json file."""
import json
import os
import platform
import subprocess
from pathlib import Path

from loguru import logger

from models.tt_transformers.demo.speculative_decoding.inputs import PACKAGE_ROOT, DemoInputError
from models.tt_transformers.demo.speculative_decoding.speculative_generator import UserResult


def summarize(batches: list[list[UserResult]]) -> dict:
    """Figures over all users (users of one batch share each iteration's time), with TT-Transformers' perf keys:
    prefill_time_to_token (s, mean over users), prefill_t/s (prompt tokens per second of prefill), decode_t/s/u and
    decode_t/s (tokens after the first per second of decoding, per user and over the batch)."""
    users = [r for batch in batches for r in batch]
    drafted = sum(it.drafted for r in users for it in r.iterations)
    accepted = sum(it.accepted for r in users for it in r.iterations)
    steps = sum(len(r.iterations) for r in users)
    produced = sum(len(r.output_tokens) - 1 for r in users)
    decode_s = sum(max(r.decode_s for r in batch) for batch in batches)
    prefill_s = sum(r.ttft_ms for r in users) / 1e3
    tok_s = produced / decode_s if decode_s else 0.0
    tok_s_u = tok_s * len(batches) / len(users)
    return {
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_tokens_per_step": produced / steps if steps else 0.0,
        "decode_tok_s": tok_s,
        "decode_tok_s_u": tok_s_u,
        "ttft_ms": sum(r.ttft_ms for r in users) / len(users),
        "prefill_time_to_token": prefill_s / len(users),
        "prefill_t/s": sum(len(r.prompt_tokens) for r in users) / prefill_s if prefill_s else 0.0,
        "decode_t/s/u": tok_s_u,
        "decode_t/s": tok_s,
    }


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
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "python": platform.python_version(), "torch": torch.__version__,
            "device": device, "git_commit": commit}


def log_performance(label: str, s: dict) -> None:
    logger.info(f"=== Performance metrics ({label}) ===")
    logger.info(f"Time to first token: {s['ttft_ms']:.1f}ms")
    ms = 1e3 / s["decode_tok_s_u"] if s["decode_tok_s_u"] else 0.0
    logger.info(f"Average speed: {ms:.1f}ms @ {s['decode_tok_s_u']:.1f} tok/s/user ({s['decode_tok_s']:.1f} tok/s throughput)")
    logger.info(f"Acceptance rate: {100 * s['acceptance_rate']:.1f}%, mean tokens per target forward: "
                f"{s['mean_tokens_per_step']:.2f}")


PROMPT_ECHO = 100  # characters of a prompt the log repeats (a code edit's prompt runs to pages)


def shorten(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "\u2026"


def log_prompt_table(entries: list[dict]) -> None:
    """Per prompt: tokens per target forward, speedup over plain decoding, which sources drafted: where it pays."""
    lines = [f"{'prompt':<44} {'tokens/forward':>14} {'speedup':>8}  drafted by"]
    for e in entries:
        speedup = f"{e['speedup']:.2f}x" if "speedup" in e else "-"
        sources = ", ".join(f"{source} {n}" for source, n in sorted(e["draft_sources"].items())) or "nothing"
        lines.append(f"{shorten(e['prompt'], 44):<44} {e['tokens_per_step']:>14.2f} {speedup:>8}  {sources}")
    logger.info("Per prompt:\n" + "\n".join(lines))


class ReportFile:
    """A JSON report file reserved before the run: its temporary file is created in the report's folder at once, so a
    path that cannot be written (a read-only folder, /proc) stops the run before it starts, whatever permission bits
    say; the report is written into that same file and renamed over the path only when whole. A run that fails or is
    interrupted calls discard(): nothing of it is left, not even the folders made for it."""

    def __init__(self, path, flag: str = "--output_json"):
        self.path = Path(path).expanduser()
        if self.path.is_dir():
            raise DemoInputError(f"{flag} {str(path)!r} is a directory; give a file path")
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
            raise DemoInputError(f"{flag} {str(path)!r} cannot be written (creating a file in {self.path.parent} "
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


def write_json_atomic(path: Path, data, flag: str = "--output_json") -> None:
    """JSON written whole or not at all (a reader never sees half a file)."""
    ReportFile(path, flag).write(data)
