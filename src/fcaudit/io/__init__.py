"""fcaudit.io: files in and out: data and tokenizers, checkpoints and model folders,
weights, output folders and run facts (docs/architecture.md)."""
