"""megatron adapter (see docs/design.md)."""
