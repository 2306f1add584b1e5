"""StateCopier: a rank's state captured on one side, read over loopback and loaded on the other."""

from __future__ import annotations

from typing import Any, Mapping

import pytest
import torch
import torch.distributed as dist

from torchpass.core.config import TorchPassConfig
from torchpass.core.control import Plan, RankPlan
from torchpass.core.rng import capture_rng, restore_rng
from torchpass.core.state_copy import StateCopier, Timings
from torchpass.core.transfer import StateServer, TransferError

from tests.support.secret import SECRET


class TinyProvider:
    """A linear model and SGD with momentum, classed as the plain API classes them."""

    def __init__(self, seed: int):
        torch.manual_seed(seed)
        self.model = torch.nn.Linear(16, 8)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.model(torch.randn(4, 16)).sum().backward()
        self.opt.step()

    def state_components(self) -> tuple[dict[str, Any], dict[str, str]]:
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}, {
            "model": "params",
            "optimizer": "optimizer",
        }

    def load_components(self, components: Mapping[str, Any], *, joining: bool) -> None:
        self.model.load_state_dict(components["model"])
        self.opt.load_state_dict(components["optimizer"])

    def discard_step(self) -> None:
        pass


def copier(provider: TinyProvider, rank: int) -> StateCopier:
    return StateCopier(rank, provider, None, TorchPassConfig(), dist.HashStore(), None, lambda: None, SECRET)


def plan_from(address: tuple[str, int]) -> Plan:
    rank_plan = RankPlan(fetch={"params": [[0, "live"]], "optimizer": [[0, "live"]]}, small_from="0/live")
    return Plan(generation=1, target_version=5, joins={"1": "w9"}, ranks={"1": rank_plan}, addresses={"0": list(address)}, cause="test")


@pytest.fixture
def source():
    provider = TinyProvider(seed=0)
    server = StateServer(secret=SECRET)
    rng = capture_rng()
    server.publish(copier(provider, 0).capture(5))
    yield provider, server, rng
    server.close()


def test_a_plan_loads_the_sources_state_and_rng(source):
    provider, server, rng = source
    expected_draw = (restore_rng(rng), torch.rand(3))[1]
    receiver = TinyProvider(seed=1)
    torch.manual_seed(123)
    timings = Timings()
    copier(receiver, 1).apply(plan_from(server.address), timings, joining=True)
    for name, value in provider.model.state_dict().items():
        assert torch.equal(receiver.model.state_dict()[name], value), name
    assert torch.equal(
        receiver.opt.state_dict()["state"][0]["momentum_buffer"], provider.opt.state_dict()["state"][0]["momentum_buffer"]
    )
    assert torch.equal(torch.rand(3), expected_draw)  # the source's RNG streams, as of its capture
    assert timings.bytes_moved > 0


def test_a_failed_read_leaves_the_live_state_untouched(source):
    provider, server, _ = source
    receiver = TinyProvider(seed=1)
    before = {k: v.clone() for k, v in receiver.model.state_dict().items()}
    bad = plan_from(server.address)
    bad.target_version = 6  # the source holds step 5 only
    with pytest.raises(TransferError):
        copier(receiver, 1).apply(bad, Timings(), joining=True)
    for name, value in receiver.model.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_a_rank_without_snapshots_says_so():
    plan = Plan(generation=1, target_version=5, joins={}, ranks={"0": RankPlan(fetch={"params": [[0, "snapshot"]]})}, addresses={}, cause="t")
    with pytest.raises(TransferError, match="keeps no snapshots"):
        copier(TinyProvider(seed=0), 0).apply(plan, Timings(), joining=False)


def test_derived_classes_stay_out_of_snapshots_but_not_out_of_what_a_rank_publishes():
    """A derived class is recomputed by the framework: a snapshot (and a fetch's receive buffers) leave it
    out, so the buddy work copies only what is moved; a published capture and a fingerprint keep it."""
    provider = TinyProvider(seed=0)
    c = StateCopier(0, provider, None, TorchPassConfig(), dist.HashStore(), None, lambda: None, SECRET, frozenset({"params"}))
    whole = c.capture(5)
    kept = c.capture(5, derived=False)
    assert {e.state_class for e in whole.manifest.entries} >= {"params", "optimizer"}
    assert "params" not in {e.state_class for e in kept.manifest.entries}
    assert kept.manifest.meta["classes"] == {"optimizer": "optimizer", "__small__": "small"}
    params_bytes = sum(p.numel() * p.element_size() for p in provider.model.parameters())
    assert whole.manifest.nbytes - kept.manifest.nbytes == params_bytes
