"""Test support for the Megatron adapter: the CPU shim, the e2e job, and a Megatron-LM stand-in."""
