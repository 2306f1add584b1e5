"""deepspeed adapter (see docs/design.md)."""
