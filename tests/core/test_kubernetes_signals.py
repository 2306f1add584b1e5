"""The Kubernetes watch, driven through the official client against the API subset of tests/support/kube_api.py.

Contract-tested: the server speaks the documented list/watch protocol (resource versions, bookmarks, 410
Gone), not a real API server (none is installable here).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Iterator

import pytest

pytest.importorskip("kubernetes")

from torchpass.core.kubernetes_signals import KubernetesSource  # noqa: E402

from tests.support.kube_api import KubeApi  # noqa: E402

TAINTS = frozenset({"ToBeDeletedByClusterAutoscaler"})


@pytest.fixture
def api() -> Iterator[KubeApi]:
    server = KubeApi()
    server.add_node("gpu-node-1")
    server.add_node("gpu-node-2")
    server.add_pod("training", "job-worker-1", "gpu-node-1", {"job": "llm"})
    server.add_pod("training", "job-worker-2", "gpu-node-2", {"job": "llm"})
    server.add_pod("training", "other", "gpu-node-1", {"job": "other"})
    yield server
    server.stop()


def _source(api: KubeApi, tmp_path: Path, node: str = "gpu-node-1") -> KubernetesSource:
    return KubernetesSource(node, "training", "job=llm", TAINTS, kubeconfig=str(api.kubeconfig(tmp_path / "kubeconfig")))


def _first(source: KubernetesSource, timeout: float = 10.0) -> list:
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = source.poll()
        if found:
            return found
        time.sleep(0.05)
    return []


def _quiet(source: KubernetesSource, for_s: float = 1.5) -> bool:
    deadline = time.time() + for_s
    while time.time() < deadline:
        if source.poll():
            return False
        time.sleep(0.05)
    return True


def test_a_cordon_of_this_node_is_a_signal_and_of_another_is_not(api: KubeApi, tmp_path: Path) -> None:
    source = _source(api, tmp_path)
    assert _quiet(source)
    api.cordon("gpu-node-2")
    assert _quiet(source)
    api.cordon("gpu-node-1")
    (found,) = _first(source)
    assert (found.cause, found.reason, found.gpu) == ("k8s-cordon", "node gpu-node-1 is cordoned", None)
    assert any("allowWatchBookmarks" in r and "resourceVersion=" in r for r in api.requests), api.requests


def test_only_the_named_taints_are_signals(api: KubeApi, tmp_path: Path) -> None:
    source = _source(api, tmp_path)
    api.taint("gpu-node-1", "example.com/gpu-firmware", "old", "PreferNoSchedule")
    assert _quiet(source)
    api.taint("gpu-node-1", "ToBeDeletedByClusterAutoscaler", "1733200000", "NoSchedule")
    (found,) = _first(source)
    assert found.cause == "k8s-taint" and found.detail["taint"] == "ToBeDeletedByClusterAutoscaler=1733200000:NoSchedule"


def test_deleting_a_job_pod_on_this_node_is_a_signal(api: KubeApi, tmp_path: Path) -> None:
    source = _source(api, tmp_path)
    api.delete_pod("training", "other", 30)  # not the job's (label) pod
    api.delete_pod("training", "job-worker-2", 30)  # the job's, on another node
    assert _quiet(source)
    api.delete_pod("training", "job-worker-1", 45)
    (found,) = _first(source)
    assert found.cause == "k8s-pod-deletion" and found.detail == {"node": "gpu-node-1", "pod": "training/job-worker-1", "grace_s": 45}


def test_a_state_present_at_start_is_a_signal_at_once(api: KubeApi, tmp_path: Path) -> None:
    api.cordon("gpu-node-1")
    (found,) = _first(_source(api, tmp_path))
    assert found.cause == "k8s-cordon"


def test_after_410_gone_the_watch_lists_again_and_misses_nothing(api: KubeApi, tmp_path: Path) -> None:
    source = _source(api, tmp_path)
    assert _quiet(source, 1.0)
    lists = sum("watch" not in r for r in api.requests)
    api.forget_history()
    api.cordon("gpu-node-1")
    (found,) = _first(source)
    assert found.cause == "k8s-cordon"
    assert sum("watch" not in r for r in api.requests) > lists, api.requests  # a new list after the 410
