"""The one exception type for input a user can fix: a bad flag, a missing file, a misshapen tensor.

The command-line entry points print its message on one line and exit with status 2; anything else
that escapes is a bug in sdx and keeps its traceback.
"""


class SdxError(Exception):
    """Input-level failure with a message that says what was wrong and what to do."""
