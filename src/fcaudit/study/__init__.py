"""fcaudit.study: the paper's study, apart from the library: training our own model
families, `reproduce` and the trend study (docs/architecture.md)."""
