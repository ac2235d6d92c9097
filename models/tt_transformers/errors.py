# SPDX-License-Identifier: Apache-2.0
"""The one error type for bad input, whoever gave it: a caller's argument, a file, a checkpoint, a demo flag."""


class UserError(ValueError):
    """Input that cannot be used: the message is one line that names the input (a parameter, a file; a flag in the
    demo) and the fix. Anything else that goes wrong is a bug and keeps its traceback."""
