# SPDX-License-Identifier: Apache-2.0
"""The one error type for bad input, whoever gave it: a caller's argument, a file, a checkpoint, a demo flag."""
import re
from typing import Optional


class UserError(ValueError):
    """Input that cannot be used: the message is one line that names the input (a parameter, a file; a flag in the
    demo) and the fix. Anything else that goes wrong is a bug and keeps its traceback.

    parameter: the argument the message names, where it names one (the library's own words); a front end that takes
    it under another name (the demo: a flag) rewrites the message with `named_as`."""

    def __init__(self, message: str, parameter: Optional[str] = None):
        super().__init__(message)
        self.parameter = parameter

    def named_as(self, name: str) -> "UserError":
        """The same error with `parameter` written as `name` (the demo: `--n_draft_tokens` for n_draft_tokens), but
        where the message states its value (`max_seq_len=8`)."""
        if self.parameter is None:
            return self
        return UserError(re.sub(rf"(?<![\w-]){re.escape(self.parameter)}\b(?!=)", name, str(self)))
