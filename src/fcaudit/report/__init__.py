"""fcaudit.report: what people read: the audit report (Markdown, HTML), its figures and
progress display, rendered from an AuditResult (docs/architecture.md)."""
