"""fcaudit.engine: the audit engine (validate, probe, record, replay, summarize, verdicts)
and the audit.json schema; docs/architecture.md shows where it sits."""
