"""The one exception type for bad user input (flags, configs, checkpoints, data files).

Raised before any process group or file is touched; the driver prints its message as a single line
and exits non-zero, so the message itself must name the problem and the fix.
"""


class UsageError(ValueError):
    """Bad input from the user; the message says what is wrong and how to fix it."""
