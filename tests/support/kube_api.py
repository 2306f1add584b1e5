"""A local HTTP server speaking the subset of the Kubernetes API that torchpass's watch uses.

Replaces: a Kubernetes API server (none is installable here). It serves, as the
API documents them, list and watch of Nodes (``/api/v1/nodes``) and of a
namespace's Pods (``/api/v1/namespaces/<ns>/pods``): ``fieldSelector``
(``metadata.name=``, ``spec.nodeName=``), ``labelSelector`` (``k=v`` terms),
one ``resourceVersion`` sequence for every object, watch events after the
requested version as JSON lines, ``BOOKMARK`` events when
``allowWatchBookmarks`` is set, ``timeoutSeconds``, and ``410 Gone`` (an
``ERROR`` event) for a version older than the retained history. Tests change
objects as kubectl would (cordon, taint, delete a pod with a grace period) and
may drop history to force a relist. torchpass reaches it through the official
``kubernetes`` client and a kubeconfig (:meth:`KubeApi.kubeconfig`).
"""

from __future__ import annotations

import copy
import json
import threading
import time
import urllib.parse
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from torchpass.core.free_port import free_port

BOOKMARK_S = 0.5
"""How often a watch that asked for bookmarks gets one."""


class KubeApi:
    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._rv = 0
        self._objects: dict[tuple[str, str, str], dict[str, Any]] = {}  # (kind, namespace, name) -> object
        self._events: list[tuple[int, str, dict[str, Any]]] = []  # (rv, type, object)
        self._oldest = 0
        self.requests: list[str] = []
        self.port = free_port()
        handler = type("Handler", (_Handler,), {"api": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="kube-api", daemon=True)
        self._thread.start()

    # ---- the test's side ---------------------------------------------------------
    def kubeconfig(self, path: Path) -> Path:
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "local", "cluster": {"server": f"http://127.0.0.1:{self.port}"}}],
                    "users": [{"name": "torchpass", "user": {"token": "test-token"}}],
                    "contexts": [{"name": "local", "context": {"cluster": "local", "user": "torchpass", "namespace": "training"}}],
                    "current-context": "local",
                }
            )
        )
        return path

    def add_node(self, name: str) -> None:
        self._put("ADDED", {"kind": "Node", "apiVersion": "v1", "metadata": {"name": name}, "spec": {}, "status": {}})

    def add_pod(self, namespace: str, name: str, node: str, labels: dict[str, str]) -> None:
        pod = {
            "kind": "Pod",
            "apiVersion": "v1",
            "metadata": {"name": name, "namespace": namespace, "labels": labels},
            "spec": {"nodeName": node, "containers": [{"name": "trainer", "image": "trainer:latest"}]},
            "status": {"phase": "Running"},
        }
        self._put("ADDED", pod)

    def cordon(self, node: str) -> None:
        """``kubectl cordon``."""
        self._modify(("Node", "", node), lambda o: o["spec"].__setitem__("unschedulable", True))

    def taint(self, node: str, key: str, value: str, effect: str) -> None:
        """``kubectl taint nodes <node> key=value:effect``."""
        self._modify(("Node", "", node), lambda o: o["spec"].setdefault("taints", []).append({"key": key, "value": value, "effect": effect}))

    def delete_pod(self, namespace: str, name: str, grace_s: int) -> None:
        """``kubectl delete pod --grace-period``: the pod is marked for deletion and stays until its grace ends."""
        stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")

        def mark(o: dict[str, Any]) -> None:
            o["metadata"]["deletionTimestamp"] = stamp
            o["metadata"]["deletionGracePeriodSeconds"] = grace_s

        self._modify(("Pod", namespace, name), mark)

    def forget_history(self) -> None:
        """Compact past every version a client holds (as after an etcd compaction with the API server restarted):
        open watches end, and each resuming from its version gets 410 Gone and must list again."""
        with self._lock:
            self._rv += 1
            self._oldest = self._rv
            self._events.clear()
            self._lock.notify_all()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    # ---- state ---------------------------------------------------------------------
    def _put(self, kind: str, obj: dict[str, Any]) -> None:
        with self._lock:
            self._rv += 1
            obj["metadata"]["resourceVersion"] = str(self._rv)
            m = obj["metadata"]
            self._objects[(obj["kind"], m.get("namespace", ""), m["name"])] = obj
            self._events.append((self._rv, kind, copy.deepcopy(obj)))
            self._lock.notify_all()

    def _modify(self, key: tuple[str, str, str], change) -> None:
        with self._lock:
            obj = copy.deepcopy(self._objects[key])
        change(obj)
        self._put("MODIFIED", obj)

    def _select(self, kind: str, namespace: str, query: dict[str, str]) -> list[dict[str, Any]]:
        out = []
        for (k, ns, _), obj in sorted(self._objects.items()):
            if k == kind and ns == namespace and _matches(obj, query):
                out.append(copy.deepcopy(obj))
        return out


def _matches(obj: dict[str, Any], query: dict[str, str]) -> bool:
    for term in filter(None, query.get("fieldSelector", "").split(",")):
        path, _, want = term.partition("=")
        value: Any = obj
        for part in path.split("."):
            value = (value or {}).get(part)
        if value != want:
            return False
    labels = obj["metadata"].get("labels", {})
    for term in filter(None, query.get("labelSelector", "").split(",")):
        key, _, want = term.partition("=")
        if labels.get(key) != want:
            return False
    return True


class _Handler(BaseHTTPRequestHandler):
    api: KubeApi
    protocol_version = "HTTP/1.1"  # watches stream as chunked transfer encoding, as the API server's do

    def log_message(self, format: str, *args: Any) -> None:
        del format, args  # quiet: the test reads api.requests

    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        query = {k: v[-1] for k, v in urllib.parse.parse_qs(url.query).items()}
        self.api.requests.append(self.path)
        parts = url.path.strip("/").split("/")
        if parts == ["api", "v1", "nodes"]:
            kind, namespace = "Node", ""
        elif len(parts) == 5 and parts[:3] == ["api", "v1", "namespaces"] and parts[4] == "pods":
            kind, namespace = "Pod", parts[3]
        else:
            self._send(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 404, "reason": "NotFound", "message": url.path})
            return
        if query.get("watch") in ("true", "True", "1"):
            self._watch(kind, namespace, query)
            return
        with self.api._lock:
            items, rv = self.api._select(kind, namespace, query), self.api._rv
        self._send(200, {"kind": f"{kind}List", "apiVersion": "v1", "metadata": {"resourceVersion": str(rv)}, "items": items})

    def _send(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _line(self, event: dict[str, Any]) -> None:
        data = json.dumps(event).encode() + b"\n"
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))  # one chunk per event
        self.wfile.flush()

    def _watch(self, kind: str, namespace: str, query: dict[str, str]) -> None:
        since = int(query.get("resourceVersion") or 0)
        deadline = time.time() + float(query.get("timeoutSeconds", 300))
        bookmarks = query.get("allowWatchBookmarks") in ("true", "True", "1")
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        try:
            self._events_after(kind, namespace, query, since, deadline, bookmarks)
            self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            return  # the client stopped watching

    def _events_after(self, kind: str, namespace: str, query: dict[str, str], since: int, deadline: float, bookmarks: bool) -> None:
        api = self.api
        with api._lock:
            if since and since < api._oldest:
                gone = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 410, "reason": "Expired",
                        "message": f"too old resource version: {since} ({api._oldest})"}  # fmt: skip
                self._line({"type": "ERROR", "object": gone})
                return
            if not since:  # no version: the current objects first, as ADDED
                for obj in api._select(kind, namespace, query):
                    self._line({"type": "ADDED", "object": obj})
                since = api._rv
        last_bookmark = time.time()
        while time.time() < deadline:
            with api._lock:
                if since < api._oldest:
                    return  # history dropped under this watch: the client resumes and gets 410
                pending = [(rv, t, o) for rv, t, o in api._events if rv > since]
                if not pending:
                    api._lock.wait(min(BOOKMARK_S, max(0.0, deadline - time.time())))
            for rv, etype, obj in pending:
                since = rv
                if obj["kind"] == kind and obj["metadata"].get("namespace", "") == namespace and _matches(obj, query):
                    self._line({"type": etype, "object": obj})
            if bookmarks and time.time() - last_bookmark >= BOOKMARK_S:
                self._line({"type": "BOOKMARK", "object": {"kind": kind, "apiVersion": "v1", "metadata": {"resourceVersion": str(since)}}})
                last_bookmark = time.time()
