"""Hydra config groups shipped with torchpass: presets, chaos scenarios, benchmark scenarios."""
