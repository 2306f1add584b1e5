"""Framework-agnostic core: protocol, topology, transfer, control plane, launcher, ledger."""
