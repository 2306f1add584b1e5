"""TorchTitan adapter: a ``[torchpass]`` section in a TorchTitan 0.2.2 job config makes its trainer migratable.

See ``docs/adapters/torchtitan.md``. Modules: :mod:`.job_config` (the section),
:mod:`.trainer` (``TorchPassTrainer``), :mod:`.train` (the entry point),
:mod:`.state` (the state provider), :mod:`.data` (replayable batches),
:mod:`.layout` (ParallelDims to layout), :mod:`.fsdp2` (FSDP2 reset),
:mod:`.replicate` (TorchTitan's DDP).
"""
