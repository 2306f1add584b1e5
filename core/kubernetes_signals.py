"""Kubernetes: a cordoned or tainted node, or a job pod being deleted, becomes a planned migration.

``kubectl drain`` cordons the node (``spec.unschedulable``) before it evicts
pods; the cluster autoscaler taints a node it is about to remove; a pod
deleted with a grace period keeps running until the grace ends. Each is
notice, and each launcher turns it into a planned migration of its node's
ranks (``core/node_signals.py``). The watch uses the official ``kubernetes``
client, in-cluster credentials when the launcher runs in a pod (else the
kubeconfig), and the API's own list-then-watch protocol:

1. list the node (``fieldSelector=metadata.name=<node>``) and the job's pods on
   it (``signals.k8s_pod_selector`` in ``signals.k8s_namespace``), and judge
   every object listed;
2. watch each from the list's ``resourceVersion`` with bookmarks, judging each
   ``ADDED``/``MODIFIED`` object and moving the version on with every event and
   bookmark; a watch that times out resumes from the last version;
3. on ``410 Gone`` (history compacted past that version) list again: step 1.

Each follows on a daemon thread of its own; the watcher's ``poll`` takes what
they found (and raises what stopped one, so it is logged and retried). The
first signal ends both: the node is leaving.
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Any, Callable

from .node_signals import NodeSignal

__all__ = ["KubernetesSource", "kubernetes_available", "in_cluster"]

WATCH_TIMEOUT_S = 300
"""How long one watch request lasts before it is renewed from the last version (the API server's own cap is
typically 5-10 minutes); renewals cost one request each."""

IN_CLUSTER_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
GONE = 410


def kubernetes_available() -> bool:
    try:
        import kubernetes  # noqa: F401
    except ImportError:
        return False
    return True


def in_cluster() -> bool:
    """This process runs in a pod (the API server's address is in its environment)."""
    return "KUBERNETES_SERVICE_HOST" in os.environ


def default_namespace() -> str:
    try:
        with open(IN_CLUSTER_NAMESPACE) as f:
            return f.read().strip()
    except OSError:
        return "default"


class KubernetesSource:
    """Watches one Kubernetes node and the job's pods on it (see the module docstring)."""

    name = "kubernetes"

    def __init__(self, node: str, namespace: str, pod_selector: str, taints: frozenset[str], kubeconfig: str = "", pod: str = ""):
        from kubernetes import client, config

        if in_cluster() and not kubeconfig:
            config.load_incluster_config()
        else:
            config.load_kube_config(config_file=kubeconfig or None)
        self.node, self.namespace, self.pod_selector, self.taints = node, namespace, pod_selector, taints
        self._api = client.CoreV1Api()
        self._found: queue.SimpleQueue[NodeSignal | BaseException] = queue.SimpleQueue()
        self._done = threading.Event()
        nodes = {"field_selector": f"metadata.name={node}"}
        # The job's pods on this node: by label, or (no selector) this launcher's own pod by name.
        pods = {"namespace": namespace, "field_selector": f"spec.nodeName={node}" + ("" if pod_selector else f",metadata.name={pod}")}
        if pod_selector:
            pods["label_selector"] = pod_selector
        for what, list_fn, kwargs, judge in (
            ("node", self._api.list_node, nodes, self._judge_node),
            ("pods", self._api.list_namespaced_pod, pods, self._judge_pod),
        ):
            threading.Thread(target=self._follow, args=(list_fn, kwargs, judge), name=f"torchpass-k8s-{what}", daemon=True).start()

    def poll(self) -> list[NodeSignal]:
        out = []
        while True:
            try:
                item = self._found.get_nowait()
            except queue.Empty:
                return out[:1]  # one signal: the node is leaving
            if isinstance(item, BaseException):
                raise RuntimeError(f"the watch stopped ({item}); it starts again") from item
            out.append(item)

    # ---- judging ---------------------------------------------------------------------
    def _judge_node(self, node: Any) -> NodeSignal | None:
        spec = node.spec
        if spec is None:
            return None
        if spec.unschedulable:
            return NodeSignal("k8s-cordon", f"node {self.node} is cordoned", {"node": self.node})
        for taint in spec.taints or []:
            if taint.key in self.taints:
                shown = f"{taint.key}={taint.value or ''}:{taint.effect}"
                return NodeSignal("k8s-taint", f"node {self.node} is tainted {shown}", {"node": self.node, "taint": shown})
        return None

    def _judge_pod(self, pod: Any) -> NodeSignal | None:
        meta = pod.metadata
        if meta is None or meta.deletion_timestamp is None:
            return None
        grace = meta.deletion_grace_period_seconds
        return NodeSignal(
            "k8s-pod-deletion",
            f"pod {meta.namespace}/{meta.name} on node {self.node} is being deleted (grace {grace} s)",
            {"node": self.node, "pod": f"{meta.namespace}/{meta.name}", "grace_s": grace},
        )

    # ---- list, then watch ------------------------------------------------------------------
    def _follow(self, list_fn: Callable[..., Any], kwargs: dict[str, Any], judge: Callable[[Any], NodeSignal | None]) -> None:
        from kubernetes import watch
        from kubernetes.client.rest import ApiException

        while not self._done.is_set():
            try:
                listed = list_fn(**kwargs)
                for item in listed.items:
                    self._judged(judge(item))
                version = listed.metadata.resource_version
                while not self._done.is_set():
                    stream = watch.Watch().stream(
                        list_fn, resource_version=version, allow_watch_bookmarks=True, timeout_seconds=WATCH_TIMEOUT_S, **kwargs
                    )
                    for event in stream:
                        version = event["raw_object"]["metadata"]["resourceVersion"]
                        if event["type"] in ("ADDED", "MODIFIED"):
                            self._judged(judge(event["object"]))
                        if self._done.is_set():
                            return
            except ApiException as exc:
                if exc.status != GONE:
                    self._found.put(exc)
                    self._done.wait(5.0)  # the watcher logs it once; the next attempt lists again
            except Exception as exc:  # the API unreachable, a malformed answer: reported, then retried
                self._found.put(exc)
                self._done.wait(5.0)

    def _judged(self, signal: NodeSignal | None) -> None:
        if signal is not None and not self._done.is_set():
            self._done.set()
            self._found.put(signal)
