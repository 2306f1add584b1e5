"""A gloo group's sockets are told apart from every other socket of the process by its address records.

Real ``ProcessGroupGloo`` groups built as a worker builds them: lazily
connected, through :class:`EndpointNotingStore`. Ranks are threads of this
process where only the records matter, and processes where the sockets do (a
thread's connection towards a peer would also be its peer's, here).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroupGloo

from torchpass.core.gloo_sockets import Endpoints, EndpointNotingStore, connected, listener_of
from torchpass.core.rendezvous_store import worker_environment

SIZE = 3


def _in_threads(fn, size: int = SIZE) -> None:
    threads = [threading.Thread(target=fn, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "a rank hung"


@pytest.fixture
def groups(monkeypatch: pytest.MonkeyPatch):
    """(store client, [(group, endpoints, its store)] for ranks 0..SIZE-1): built, not yet connected."""
    for name, value in worker_environment({}).items():
        monkeypatch.setenv(name, value)
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, 1, False, timeout=timedelta(seconds=30))
    built: list = [None] * SIZE

    def build(r: int) -> None:
        endpoints = Endpoints()
        store = EndpointNotingStore(dist.PrefixStore("g/", client), endpoints)
        built[r] = (ProcessGroupGloo(store, r, SIZE, timedelta(seconds=30)), endpoints, store)  # the store lives as long

    _in_threads(build)
    yield client, built


def _allreduce(built) -> None:
    _in_threads(lambda r: built[r][0].allreduce([torch.ones(4)]).wait())


def test_the_records_name_the_listeners_every_connection_is_made_to(groups) -> None:
    client, built = groups
    before = connected()
    _allreduce(built)
    listeners = [next(iter(endpoints.own)) for _, endpoints, _ in built]
    assert len(set(listeners)) == SIZE, "a listener of its own per group"
    for r, (_, endpoints, _) in enumerate(built):
        assert endpoints.peers == set(listeners) - {listeners[r]}, "a ring of three reads both peers' records"
    new = [c for c in connected() if c not in before]
    assert new and all((c.local in listeners) != (c.peer in listeners) for c in new), "one end of each at a listener"
    with pytest.raises(ValueError, match="not a gloo address record"):
        listener_of(b"\x05\x00")


_RANK = textwrap.dedent(
    """
    import json, os, sys
    from datetime import timedelta
    import torch, torch.distributed as dist
    from torch._C._distributed_c10d import ProcessGroupGloo
    from torchpass.core.gloo_sockets import Endpoints, EndpointNotingStore, connected, shut_down
    from torchpass.core.rendezvous_store import worker_environment

    rank, size, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    os.environ.update(worker_environment(os.environ))
    store = dist.TCPStore("127.0.0.1", port, size, False, timeout=timedelta(seconds=60))
    other = dist.TCPStore("127.0.0.1", port, size, False, timeout=timedelta(seconds=60))  # a second non-gloo connection
    endpoints = Endpoints()
    noting = EndpointNotingStore(dist.PrefixStore("g/", store), endpoints)
    group = ProcessGroupGloo(noting, rank, size, timedelta(seconds=60))
    built = connected()
    # Every rank looks before any connects: a peer's first collective connects to this rank's listener.
    store.set(f"built/{rank}", "1")
    store.wait([f"built/{r}" for r in range(size)])
    group.allreduce([torch.ones(4)]).wait()
    after = connected()
    out = {
        "owned_before": [c.fd for c in built if endpoints.owns(c.local, c.peer)],
        "new": sorted(c.fd for c in after if c not in built),
        "owned": sorted(c.fd for c in after if endpoints.owns(c.local, c.peer)),
    }
    store.set(f"connected{rank}", "1")
    store.wait([f"connected{r}" for r in range(size)])  # every rank has listed its sockets before any shuts down
    if rank == 0:
        out["shut_down"] = shut_down(connected(), endpoints)
        try:
            group.allreduce([torch.ones(4)]).wait(timedelta(seconds=20))
            out["next"] = "completed"
        except RuntimeError as exc:
            out["next"] = str(exc)[:200]
        other.set("after", "release")
        out["store"] = other.get("after").decode()
        store.set("done", "1")
    else:
        store.wait(["done"])
    print("RESULT" + json.dumps(out), flush=True)
    os._exit(0)
    """
)


def test_each_rank_owns_its_ends_of_its_groups_connections_and_nothing_else() -> None:
    """Ranks as processes, as in a job: the group's connections are exactly its sockets; shutting them down
    fails its next collective and leaves the store's connections alone."""
    size = 3
    # The store's server runs here: its connections accepted from the ranks would be new sockets of rank 0.
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=60), wait_for_workers=False)
    port = server.port
    procs = [
        subprocess.Popen([sys.executable, "-c", _RANK, str(r), str(size), str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(size)
    ]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    results = []
    for out, err in outs:
        line = next((ln for ln in out.splitlines() if ln.startswith("RESULT")), None)
        assert line is not None, err[-3000:]
        results.append(json.loads(line[len("RESULT") :]))
    for r, result in enumerate(results):
        assert result["owned_before"] == [], "lazy: nothing connected before the first collective"
        # Three ranks, three pairs: each rank holds one end of two, and every connection it made is the group's.
        assert len(result["owned"]) == 2 and result["owned"] == result["new"], (r, result)
    assert results[0]["shut_down"] == 2
    assert results[0]["next"] != "completed"
    assert results[0]["store"] == "release"
