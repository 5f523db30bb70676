"""Self-contained studies that reproduce results of the source papers (see docs/TRIGGER.md)."""
