"""``torchpass status``: the recorded picture of a finished job, the live one only with the job's secret."""

from __future__ import annotations

import io
import json
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from torchpass.core.control import Heartbeat, Keys, put, signed
from torchpass.core.job_secret import SECRET_ENV, SecretError
from torchpass.core.status import CLEAR, format_status, watch_status

from torchpass.core.etcd_store import EtcdStore, job_url, parse_etcd_url

from tests.support.etcd import ETCD, EtcdCluster
from tests.support.secret import SECRET


def _workers_json(run_dir: Path, store: str) -> None:
    run_dir.mkdir(parents=True)
    row = {"wid": "n0-a0", "node": 0, "pid": 4242, "role": "active", "rank": 0, "generation": 0, "transfer_addr": None}
    (run_dir / "workers.json").write_text(json.dumps({"generation": 0, "world_size": 1, "store": store, "workers": [row], "nodes": {}}))


@pytest.fixture
def live(tmp_path, monkeypatch) -> tuple[Path, Path]:
    """A run dir whose store is up, holding rank 0's heartbeat sealed with the job secret."""
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "runtime"))
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    put(signed(server, SECRET, timedelta(seconds=5)), Keys.heartbeat("n0-a0"), Heartbeat(0.0, 7, 0, "train", 3))
    run_dir = tmp_path / "run"
    _workers_json(run_dir, f"127.0.0.1:{server.port}")
    secret_file = tmp_path / "job.secret"
    secret_file.write_bytes(SECRET)
    yield run_dir, secret_file
    del server


def test_a_live_job_shows_its_heartbeats_with_the_secret(live):
    run_dir, secret_file = live
    out = format_status(run_dir, str(secret_file))
    assert "n0-a0" in out and "train" in out and "      7 " in out


def test_a_live_job_without_the_secret_is_refused_naming_the_ways_to_give_it(live):
    run_dir, _ = live
    with pytest.raises(SecretError, match="--secret-file PATH or set TORCHPASS_SECRET"):
        format_status(run_dir)


def test_a_finished_job_needs_no_secret(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there any more
    _workers_json(tmp_path / "run", f"127.0.0.1:{port}")
    assert "store unreachable: showing the last recorded state" in format_status(tmp_path / "run")


def test_a_job_on_etcd_shows_the_heartbeats_kept_there_and_its_end(tmp_path, monkeypatch):
    """With the control plane on etcd, node 0's set-up store (gone with node 0 after a take-over) holds no heartbeat."""
    if ETCD is None:
        pytest.skip("etcd is not installed here (.ci/run installs etcd-server)")
    monkeypatch.delenv(SECRET_ENV, raising=False)
    cluster = EtcdCluster(tmp_path / "etcd", members=1)
    (tmp_path / "etcd").mkdir()
    cluster.start()
    try:
        url = job_url(cluster.url, "status")
        store = signed(EtcdStore(parse_etcd_url(url)), SECRET, timedelta(seconds=5))
        put(store, Keys.job, {"world_size": 1})
        put(store, Keys.heartbeat("n0-a0"), Heartbeat(0.0, 7, 0, "train", 3))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]  # node 0's set-up store: nothing listens there
        _workers_json(tmp_path / "run", f"127.0.0.1:{port}")
        data = json.loads((tmp_path / "run" / "workers.json").read_text())
        (tmp_path / "run" / "workers.json").write_text(json.dumps({**data, "store_etcd": url}))
        (tmp_path / "job.secret").write_bytes(SECRET)
        out = format_status(tmp_path / "run", str(tmp_path / "job.secret"))
        assert "n0-a0" in out and "train" in out and "      7 " in out
        EtcdStore(parse_etcd_url(url)).delete_prefix()  # the job ended: its keys went with it
        assert "store unreachable: showing the last recorded state" in format_status(tmp_path / "run")
    finally:
        cluster.stop()


def test_watch_redraws_the_live_view_with_the_migration_phase_until_the_job_ends(live):
    run_dir, secret_file = live
    data = json.loads((run_dir / "workers.json").read_text())
    data["migration"] = {"generation": 1, "phase": "joining", "cause": "slurm-drain", "since": time.time() - 2.0, "message": "node 1 is draining"}
    (run_dir / "workers.json").write_text(json.dumps(data))
    out = io.StringIO()
    watcher = threading.Thread(target=watch_status, args=(run_dir, str(secret_file), 0.05, out))
    watcher.start()
    time.sleep(0.3)
    (run_dir / "summary.json").write_text(json.dumps({"exit_code": 0, "message": "training completed"}))
    watcher.join(10)
    assert not watcher.is_alive()
    frames = out.getvalue().split(CLEAR)[1:]
    assert len(frames) >= 2
    assert "migration to generation 1: joining for 2." in frames[0] and "(slurm-drain: node 1 is draining)" in frames[0]
    assert "train" in frames[0]  # the live heartbeat, through one store connection kept across redraws
    assert "job ended (exit code 0): training completed" in frames[-1]

