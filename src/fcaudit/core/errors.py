"""User-facing errors.

Every failure a user can cause (bad input, missing file, wrong checkpoint) raises
:class:`FcauditError` with a one-line message that names the input and says what to
do. The CLI prints it without a traceback and exits non-zero.
"""


class FcauditError(Exception):
    """A problem with the user's input or environment, explained in one line."""


def check_sizes(config: object, names: tuple[str, ...]) -> None:
    """Refuse config sizes that are not positive integers, quoting the value as read (a
    JSON 1e9 is a float, a true is a bool: neither is silently cast)."""
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise FcauditError(f"{name}={value!r} must be a positive integer")
