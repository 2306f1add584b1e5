"""Thin integrations of torchpass with DeepSpeed, Megatron and TorchTitan."""
