"""fcaudit.report.audit_report: see docs/architecture.md."""
