# SPDX-License-Identifier: Apache-2.0
"""The one error type for bad input, whoever gave it: a caller's argument, a file, a checkpoint, a demo flag; and the
checks every entry point runs on its arguments (check_int, check_number, check_bool, ...), so that a wrong type, a
value out of range or a falsy value is refused in the same words everywhere, before any work."""
import math
import numbers
import operator
import re
from typing import Callable, Optional, Sequence


class UserError(ValueError):
    """Input that cannot be used: the message is one line that names the input (a parameter, a file; a flag in the
    demo) and the fix. Anything else that goes wrong is a bug and keeps its traceback.

    parameter: the argument the message names, where it names one (the library's own words); a front end that takes
    it under another name (the demo: a flag) rewrites the message with `named_as`. also: other arguments the message
    names (a setting that needs another: top_k needs temperature), rewritten with it."""

    def __init__(self, message: str, parameter: Optional[str] = None, also: Sequence[str] = ()):
        super().__init__(message)
        self.parameter, self.also = parameter, tuple(also)

    def named_as(self, name: str) -> "UserError":
        """The same error with `parameter` written as `name` (the demo: `--n_draft_tokens` for n_draft_tokens), but
        where the message states its value (`max_seq_len=8`)."""
        return self.named_with(lambda parameter: name if parameter == self.parameter else parameter)

    def named_with(self, name_of: Callable[[str], str]) -> "UserError":
        """The same error with `parameter` and `also` each written as name_of(it)."""
        if self.parameter is None:
            return self
        message = str(self)
        for parameter in (self.parameter, *self.also):
            message = re.sub(rf"(?<![\w-]){re.escape(parameter)}\b(?!=)", name_of(parameter), message)
        return UserError(message)


def described(value) -> str:
    """A refused value as the message shows it: its repr and, where the repr hides it, its type (8.0 (float32)); a
    value whose repr is long or spans lines (a model) by its type alone."""
    shown = repr(value)
    if "\n" in shown or len(shown) > 60:
        return a(type(value).__name__)
    return shown if type(value) in (int, float, str, type(None)) else f"{shown} ({type(value).__name__})"


def a(noun: str) -> str:
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def refused(name: str, rest: str) -> UserError:
    """`name rest` as a UserError whose parameter is the argument `name` is part of (prompts for prompts[2][5])."""
    return UserError(f"{name} {rest}", name.partition("[")[0])


def _range(lo, hi) -> str:
    if lo is not None and hi is not None:
        return f" between {lo} and {hi}"
    return f" >= {lo}" if lo is not None else f" <= {hi}" if hi is not None else ""


def _fix(fix: str) -> str:
    return f" ({fix})" if fix else ""


def _is_bool(value) -> bool:
    return isinstance(value, bool) or type(value).__name__ == "bool_"  # numpy's too


def is_whole_number(value) -> bool:
    """An int, numpy's, a 0-d torch integer (anything with __index__), but not a bool."""
    if _is_bool(value):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def check_int(name: str, value, lo: Optional[int] = None, hi: Optional[int] = None, fix: str = "") -> int:
    """`value` as an int in [lo, hi]: a whole number (numpy's and 0-d torch integers too), never a bool, a float
    (8.5, or 8.0) or a string. fix: what the message adds after the rule (`0 = plain decoding`)."""
    if not is_whole_number(value) or (lo is not None and operator.index(value) < lo) or (
            hi is not None and operator.index(value) > hi):
        raise refused(name, f"must be a whole number{_range(lo, hi)}{_fix(fix)}, got {described(value)}")
    return operator.index(value)


def check_number(name: str, value, lo: Optional[float] = None, hi: Optional[float] = None, lo_open: bool = False,
                 fix: str = "") -> float:
    """`value` as a finite float in [lo, hi] ((lo, hi] with lo_open): an int or a float, never a bool or a string
    (nan and inf pass a bare `< lo`)."""
    ok = isinstance(value, numbers.Real) and not _is_bool(value) and math.isfinite(value)
    if ok and lo is not None:
        ok = value > lo if lo_open else value >= lo
    if ok and hi is not None:
        ok = value <= hi
    if not ok:
        rule = f" in ({lo}, {hi}]" if lo_open and hi is not None else f" > {lo}" if lo_open else _range(lo, hi)
        raise refused(name, f"must be a finite number{rule}{_fix(fix)}, got {described(value)}")
    return float(value)


def check_bool(name: str, value) -> bool:
    """`value` as a bool: True or False only (`trees="no"` is truthy, so a string would turn the setting on)."""
    if not _is_bool(value):
        raise refused(name, f"must be True or False, got {described(value)}")
    return bool(value)


def check_choice(name: str, value, choices: Sequence[str]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise refused(name, f"{described(value)} is not one of {', '.join(choices)}")
    return value


def check_instance(name: str, value, kind: type, fix: str) -> None:
    """`value` is a `kind` (a SpeculativeConfig where a dict was passed); fix: how to make one."""
    if not isinstance(value, kind):
        raise refused(name, f"must be {a(kind.__name__)}, got {described(value)}; {fix}")


def check_implements(name: str, value, protocol: type, members: Sequence[str], fix: str) -> None:
    """`value` has the members of `protocol` (a typing.Protocol: a CausalLM, a Drafter) the caller uses, so a raw
    model or a config passed in its place is refused here, not deep inside the first call."""
    missing = [m for m in members if not hasattr(value, m)]
    if missing:
        raise refused(name, f"must be {a(protocol.__name__)}, got {described(value)}, which has no {missing[0]!r}; "
                            f"{fix}")


def check_sequence(name: str, value, fix: str) -> list:
    """`value` as a list: a list, tuple, tensor or other iterable, never text (whose characters would pass as items);
    fix: what to pass instead."""
    if isinstance(value, (str, bytes)):
        raise refused(name, f"is text ({described(value)}); {fix}")
    try:
        return list(value)
    except TypeError:
        raise refused(name, f"must be a list, got {described(value)}; {fix}") from None


def check_token_ids(name: str, ids, vocab_size: int, fix: str = "encode the text with the target's tokenizer"
                    ) -> list[int]:
    """`ids` as a list of token ids in [0, vocab_size): a list, tuple or 1-d tensor of whole numbers, never text."""
    tokens = check_sequence(name, ids, fix)
    if all(type(t) is int for t in tokens) and (not tokens or 0 <= min(tokens) and max(tokens) < vocab_size):
        return tokens  # the usual case, at once (a corpus of a million tokens)
    out = []
    for i, t in enumerate(tokens):
        if not is_whole_number(t) or not 0 <= operator.index(t) < vocab_size:
            raise refused(f"{name}[{i}]", f"= {described(t)} is not a token id of the model's vocabulary "
                                          f"[0, {vocab_size}); {fix}")
        out.append(operator.index(t))
    return out


def check_token_lists(name: str, lists, vocab_size: int, fix: str) -> list[list[int]]:
    """`lists` as lists of token ids (prompts, documents): a list of them, not one of them, nor text."""
    lists = check_sequence(name, lists, fix)
    if lists and is_whole_number(lists[0]):
        raise refused(name, f"is one list of token ids; {fix}: [ids]")
    return [check_token_ids(f"{name}[{i}]", ids, vocab_size) for i, ids in enumerate(lists)]
