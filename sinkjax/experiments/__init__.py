"""Self-contained studies that reproduce results of the source papers (docs/TRIGGER.md, docs/RESULTS.md,
docs/STREAMING.md's passkey probe)."""
