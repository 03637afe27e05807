"""Checkpoint files without a model: metadata, chunk geometry, shape rules, the audit, the commit protocol."""
