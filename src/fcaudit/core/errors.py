"""User-facing errors, in the caller's words.

Every failure a user can cause (bad input, missing file, wrong checkpoint) raises
:class:`FcauditError` with a one-line message that names the input and says what to
do. The CLI prints it without a traceback and exits non-zero.

A message names an option through :func:`arg`: a Python caller reads the argument
(``sites=``), the command line reads the flag (``--sites``), and neither reads the
other's. ``str(error)`` is the Python form; :meth:`FcauditError.for_cli` the CLI's.
"""

import re
import shlex

_MARK = "\x1f"  # wraps PY\x1eCLI in a message until it is rendered for its reader
_ARG = re.compile(f"{_MARK}([^{_MARK}\x1e]*)\x1e([^{_MARK}]*){_MARK}")


_UNSET = object()


def arg(name: str, value: object = _UNSET, *, owner: str = "", py: str = "",
        cli: str = "") -> str:
    """An option named in a message, for either reader: Python reads ``name=`` (with
    ``owner``, ``owner(name=...)``), the CLI reads ``--name`` (underscores become dashes);
    with ``value``, ``name=VALUE`` against ``--name VALUE``. ``py``/``cli`` spell a form
    out where it is not derived (``arg("text", cli="--data")``: DataSpec's ``text=``)."""
    flag = cli or "--" + name.replace("_", "-")
    if value is _UNSET:
        python = py or (f"{owner}({name}=...)" if owner else f"{name}=")
        return f"{_MARK}{python}\x1e{flag}{_MARK}"
    python = py or name
    python = f"{owner}({python}={value!r})" if owner else f"{python}={value!r}"
    return f"{_MARK}{python}\x1e{flag} {shlex.quote(str(value))}{_MARK}"


def install_extra(extra: str) -> str:
    """How to install one of fcaudit's optional extras, said the one way that works:
    fcaudit is not on PyPI, so an extra asked of the package by name fails, and it is
    installed from the clone (every suggestion of an extra is this text)."""
    return f'pip install -e ".[{extra}]" in the fcaudit clone'


def render(message: str, cli: bool = False) -> str:
    """``message`` with every :func:`arg` in the Python (default) or the CLI form."""
    return _ARG.sub(lambda m: m.group(2 if cli else 1), message)


class FcauditError(Exception):
    """A problem with the user's input or environment, explained in one line.

    The subclasses say which kind of input is at fault and carry it as fields, so a
    caller can branch on the kind (``except DataError``) and read what was wrong
    (``error.path``) without parsing the sentence; the message and the CLI's exit code are
    the same for every kind."""

    def __init__(self, message: str) -> None:
        super().__init__(message)

    def __str__(self) -> str:
        return render(super().__str__())

    def __format__(self, spec: str) -> str:
        """Unrendered, so ``f"... {exc}"`` quoting this error inside another keeps its
        options for the final reader."""
        return format(self.raw, spec)

    @property
    def raw(self) -> str:
        """The message with its options unrendered, to quote inside another message."""
        return super().__str__()

    def for_cli(self) -> str:
        return render(self.raw, cli=True)


class UsageError(FcauditError):
    """An argument or option outside its domain, or options that contradict each other."""

    def __init__(self, message: str, *, option: str | None = None) -> None:
        super().__init__(message)
        self.option = option  # the Python name of the option at fault, where one is


class DataError(FcauditError):
    """Evaluation or calibration data that cannot be read or does not fit the model."""

    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path  # the file or folder read, where one was


class ModelError(FcauditError):
    """A model, checkpoint, site or dense twin that cannot be audited as given."""

    def __init__(self, message: str, *, site: str | None = None) -> None:
        super().__init__(message)
        self.site = site  # the controller site at fault, where one is


class IdentityError(ModelError):
    """The identity replay, or an adapter's rebuild, does not reproduce the recorded pass
    bit for bit: no number of the audit can be trusted."""

    def __init__(self, message: str, *, site: str | None = None,
                 max_abs_diff: float | None = None) -> None:
        super().__init__(message, site=site)
        self.max_abs_diff = max_abs_diff


class CacheError(FcauditError):
    """An output folder or cached result that cannot be reused: not written by fcaudit,
    written for another model or data, or no longer reproduced by a fresh pass."""

    def __init__(self, message: str, *, folder: str | None = None,
                 batch: int | None = None) -> None:
        super().__init__(message)
        self.folder, self.batch = folder, batch


def check_sizes(config: object, names: tuple[str, ...]) -> None:
    """Refuse config sizes that are not positive integers, quoting the value as read (a
    JSON 1e9 is a float, a true is a bool: neither is silently cast)."""
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise FcauditError(f"{name}={value!r} must be a positive integer")
