"""fcaudit.core: see docs/architecture.md."""
