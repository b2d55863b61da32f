"""Command line: ``fcaudit {train,audit,compare,demo,bench,sites,reproduce}``.

User errors print one line and exit with status 2; ``--debug`` shows tracebacks. Nothing
heavy is imported at the top, so ``--help`` and argument errors are instant.
:mod:`fcaudit.cli.parser` builds the parser (the ``AuditOptions`` flags generated from
their fields), :mod:`fcaudit.cli.commands` runs the commands.
"""

from fcaudit.cli.commands import main, print_summary
from fcaudit.cli.parser import build_parser, user_file, user_path

__all__ = ["build_parser", "main", "print_summary", "user_file", "user_path"]
