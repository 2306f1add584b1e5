"""Test support: multi-process job harness, reference jobs and framework CPU shims."""
