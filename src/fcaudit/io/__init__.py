"""fcaudit.io: see docs/architecture.md."""
