"""placeholder until python -m fcaudit.study.demo writes it."""

PINNED: dict[str, dict[str, str]] = {}
