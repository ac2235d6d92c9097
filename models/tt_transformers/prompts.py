# SPDX-License-Identifier: Apache-2.0
"""Prompts in, token ids out: a prompts file (TT's JSON list of {"prompt": ...}, or JSON Lines), each prompt encoded
as the model's chat template asks, the ids that end a response, and prompts split into batches as TT demos do."""
import json
from pathlib import Path

from .errors import UserError


def load_prompts(path, name: str = "prompts file") -> list[str]:
    """TT format (a JSON list of {"prompt": ...}) or JSON Lines with a "prompt" field (one line is one object).
    `name`: how errors call the file (the demo: its flag)."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise UserError(f"{name} {str(path)!r} is a directory; pass a JSON or JSON Lines prompts file in it")
    if not p.is_file():
        raise UserError(f"{name} {str(path)!r} does not exist; pass a JSON or JSON Lines prompts file")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{name} {path}: not UTF-8 text (byte {e.start}); save it as UTF-8") from None
    example = '[{"prompt": "..."}] or one {"prompt": "..."} per line'
    try:
        entries = json.loads(text)
    except json.JSONDecodeError:
        entries = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                entries.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise UserError(f"{name} {path}: neither JSON nor JSON Lines (line {number}: {e.msg} at column "
                                f"{e.colno}); expected {example}") from None
    if isinstance(entries, dict):
        entries = [entries]  # JSON Lines with a single line
    if not isinstance(entries, list) or not entries:
        raise UserError(f"{name} {path}: holds no prompts; expected a non-empty {example}")
    prompts = []
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or not isinstance(e.get("prompt"), str):
            raise UserError(f"{name} {path}: entry {i} has no string \"prompt\" field; expected {example}")
        if not e["prompt"].strip():
            raise UserError(f"{name} {path}: entry {i} has an empty prompt; give it some text or remove it")
        prompts.append(e["prompt"])
    return prompts


def encode(tokenizer, prompt: str, instruct: bool) -> list[int]:
    """The prompt's token ids: inside the tokenizer's chat template (as a user turn, the assistant's turn opened)
    when `instruct` and the tokenizer has one, else as plain text."""
    if instruct and tokenizer.chat_template:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                  add_generation_prompt=True, return_dict=True)["input_ids"])
    return tokenizer(prompt).input_ids


def eos_token_ids(ckpt, tokenizer) -> list[int]:
    """Every id that ends a response: config.json's and generation_config.json's, and the tokenizer's."""
    return sorted(set(ckpt.eos_token_ids) | {tokenizer.eos_token_id} - {None})


def split_batches(n_prompts: int, batch_size: int) -> list[list[int]]:
    """Prompt indices per batch; the last batch is filled by repeating prompts, as TT demos do."""
    n_batches = -(-n_prompts // batch_size)
    return [[(b * batch_size + i) % n_prompts for i in range(batch_size)] for b in range(n_batches)]
