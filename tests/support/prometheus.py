"""A real Prometheus server for the tests (Debian's ``prometheus``; ``.ci/run`` installs it when absent).

It runs as a child of the test process from a private directory, scraping the
targets a test names every second, and is queried through its HTTP API as an
operator's dashboard would.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from torchpass.core.free_port import free_port


@dataclass
class Prometheus:
    url: str
    proc: subprocess.Popen
    log: Path

    def query(self, expr: str) -> list[dict]:
        """An instant query's result vector: ``[{"metric": {...labels}, "value": [t, "v"]}, ...]``."""
        with urllib.request.urlopen(f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}", timeout=10) as resp:
            body = json.load(resp)
        assert body["status"] == "success", body
        return body["data"]["result"]

    def wait_value(self, expr: str, want: float, timeout: float = 60.0) -> None:
        """Until the query's single value is ``want`` (scrapes run every second)."""
        deadline = time.time() + timeout
        got: list[dict] = []
        while time.time() < deadline:
            got = self.query(expr)
            if len(got) == 1 and float(got[0]["value"][1]) == want:
                return
            time.sleep(0.25)
        raise AssertionError(f"{expr} never became {want}: {got}\n{self.log.read_text()[-2000:]}")

    def wait_any(self, expr: str, timeout: float = 60.0) -> None:
        """Until the query returns something (a PromQL filter such as ``x >= 8`` that has become true)."""
        deadline = time.time() + timeout
        while not self.query(expr):
            if time.time() > deadline:
                raise AssertionError(f"{expr} never held\n{self.log.read_text()[-2000:]}")
            time.sleep(0.25)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_prometheus(root: Path, targets: list[str]) -> Prometheus:
    exe = shutil.which("prometheus")
    if exe is None:
        pytest.skip("Prometheus is not installed: apt-get install prometheus")
    root.mkdir(parents=True, exist_ok=True)
    config = root / "prometheus.yml"
    listed = ", ".join(f"'{t}'" for t in targets)
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        f"scrape_configs:\n  - job_name: torchpass\n    static_configs:\n      - targets: [{listed}]\n"
    )
    port = free_port()
    log = root / "prometheus.log"
    proc = subprocess.Popen(
        [exe, f"--config.file={config}", f"--storage.tsdb.path={root / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=open(log, "w"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    server = Prometheus(f"http://127.0.0.1:{port}", proc, log)
    deadline = time.time() + 60
    while True:
        try:
            with urllib.request.urlopen(f"{server.url}/-/ready", timeout=2) as resp:
                if resp.status == 200:
                    return server
        except OSError:
            pass  # not listening yet
        if proc.poll() is not None or time.time() > deadline:
            server.stop()
            raise AssertionError(f"Prometheus did not become ready:\n{log.read_text()[-2000:]}")
        time.sleep(0.2)
