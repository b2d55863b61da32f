"""fcaudit.audit: see docs/architecture.md."""
