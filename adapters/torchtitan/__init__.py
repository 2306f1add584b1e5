"""torchtitan adapter (see docs/design.md)."""
