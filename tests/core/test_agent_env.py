"""The environment the agent gives each slot: workers and spares see torchrun's variables, a spare its own GPU slot."""

from __future__ import annotations

import os
from pathlib import Path

import torch.distributed as dist

from torchpass.core import worker
from torchpass.core.agent import Agent, NodeSpec
from torchpass.core.config import TorchPassConfig


def _agent(tmp_path: Path) -> Agent:
    spec = NodeSpec(1, 2, 4, 2, "127.0.0.1", 29500, "run", tmp_path, ["train.py"], tee=False)
    agent = Agent(spec, dist.HashStore(), TorchPassConfig(), lambda line: None, b"0" * 64)
    # Its store watchdog would end this process once no store operation marked the store alive for the
    # bound (the agent's own exit path); nothing ticks this agent, so the watch is turned off.
    agent._watchdog.bound_s = float("inf")
    return agent


def test_a_worker_sees_what_torchrun_gives_it(tmp_path: Path) -> None:
    env = _agent(tmp_path)._env("n1-a2", "active", 6, 2)
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")} == {
        "RANK": "6", "LOCAL_RANK": "2", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
    }  # fmt: skip
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"  # torchpass aborts NCCL itself (core/nccl_transport.py)
    assert env["GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER"] == "1"  # O(1)-byte gloo address records (core/rendezvous_store.py)
    assert env["TORCH_GLOO_LAZY_INIT"] == "1"  # a gloo rendezvous of O(log N) records (core/rendezvous_store.py)


def test_a_spare_owns_the_slot_after_the_workers_and_keeps_it_as_a_rank(tmp_path: Path, monkeypatch) -> None:
    env = _agent(tmp_path)._env("n1-s1", "spare", None, 5)
    assert "RANK" not in env and env["LOCAL_RANK"] == "5" and env["LOCAL_WORLD_SIZE"] == "4"
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    worker._become_rank(6)  # it takes over rank 6, whose slot was 2 (a failed GPU, maybe)
    assert os.environ["RANK"] == "6" and os.environ["TORCHPASS_ROLE"] == "active"
    assert os.environ["LOCAL_RANK"] == "5"  # set_device(LOCAL_RANK) lands on the spare's own GPU
