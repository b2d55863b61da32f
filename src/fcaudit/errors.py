"""User-facing errors.

Every failure a user can cause (bad input, missing file, wrong checkpoint) raises
:class:`FcauditError` with a one-line message that names the input and says what to
do. The CLI prints it without a traceback and exits non-zero.
"""


class FcauditError(Exception):
    """A problem with the user's input or environment, explained in one line."""
