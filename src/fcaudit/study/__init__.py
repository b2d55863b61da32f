"""fcaudit.study: see docs/architecture.md."""
