"""A record nobody can act on never takes a reader down: the controller and the agents log it, record it, carry on.

Against a real TCPStore: malformed entries, entries of another shape, a record
whose poster died between numbering it and writing it, and a well-formed
report whose content makes no sense.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from torchpass.core.config import TorchPassConfig
from torchpass.core.control import Keys, Mailbox, Report
from torchpass.core.controller import Controller, JobSpec
from torchpass.core.free_port import free_port


def _store() -> dist.TCPStore:
    port = free_port()
    return dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


def _write_raw(store: dist.Store, key: str, raw: bytes) -> None:
    n = store.add(f"{key}/seq", 1)
    store.set(f"{key}/{n}", raw)


def test_the_mailbox_skips_what_does_not_decode_and_keeps_order() -> None:
    store = _store()
    box = Mailbox(store, "box")
    box.post(Report("spare_ready", "n0-s0", 0))
    _write_raw(store, "box", b"\x80\x04not json")
    _write_raw(store, "box", b"[1, 2, 3]")
    _write_raw(store, "box", json.dumps({"kind": "exit", "surprise": 1}).encode())
    box.post(Report("spare_ready", "n0-s1", 0))
    bad: list[str] = []
    got = [r.wid for r in Mailbox(store, "box").drain(Report, on_bad=lambda key, why: bad.append(key))]
    assert got == ["n0-s0", "n0-s1"]
    assert bad == ["box/2", "box/3", "box/4"]


def test_a_numbered_but_unwritten_entry_is_waited_for_then_skipped() -> None:
    store = _store()
    reader = Mailbox(store, "box", missing_after_s=0.0)
    patient = Mailbox(store, "box", missing_after_s=3600.0)
    store.add("box/seq", 1)  # a poster that died between add and set
    Mailbox(store, "box").post(Report("spare_ready", "n0-s0", 0))
    bad: list[str] = []
    # Not blocking and not skipping while the entry may still be being written...
    assert list(patient.drain(Report, on_bad=lambda key, why: bad.append(key))) == [] and bad == []
    # ...and skipped once it has been missing for longer than the bound (here: no wait at all).
    assert [r.wid for r in reader.drain(Report, on_bad=lambda key, why: bad.append(why))] == ["n0-s0"]
    assert len(bad) == 1 and "never written" in bad[0]


def test_the_controller_records_a_bad_record_and_carries_on(tmp_path: Path) -> None:
    store = _store()
    said: list[str] = []
    spec = JobSpec(world_size=2, nnodes=1, nproc_per_node=2, spares_per_node=1, run_id="t", command=["train.py"])
    controller = Controller(store, spec, tmp_path, TorchPassConfig(), said.append, lambda node, order: None, "127.0.0.1:0")
    _write_raw(store, Keys.events, b"garbage")
    _write_raw(store, Keys.events, json.dumps({"kind": "exit", "wid": "n0-a0", "unexpected": True}).encode())
    Mailbox(store, Keys.events).post(Report("spawned", "n0-a9", 0, detail={}))  # no pid, no role: makes no sense
    Mailbox(store, Keys.events).post(Report("spare_ready", "n0-s0", 0))
    controller.tick()
    assert controller.outcome is None
    assert controller.spares == {"n0-s0": 0}, "a good record after bad ones was not processed"
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    bad = [e for e in events if e["type"] == "bad_record"]
    assert len(bad) == 3, events
    assert sum("ignoring record" in line for line in said) == 3


def _controller_in_migration(tmp_path: Path, failed: set[int], fenced: list[str]):
    from torchpass.core.controller import _Migration

    store = _store()
    spec = JobSpec(world_size=4, nnodes=1, nproc_per_node=4, spares_per_node=1, run_id="t", command=["train.py"])
    controller = Controller(store, spec, tmp_path, TorchPassConfig(), lambda line: None, lambda node, order: fenced.append(order["fence"]), "127.0.0.1:0")
    controller.members = {r: f"n0-a{r}" for r in range(4)}
    controller.migration = _Migration(generation=1, cause="kill" if failed else "progress", classification="qualifying", t_fault=0.0, t_detect=0.0, failed=set(failed))
    return controller


def test_a_survivor_fenced_beside_a_lost_rank_is_recorded_with_the_migration(tmp_path: Path) -> None:
    fenced: list[str] = []
    controller = _controller_in_migration(tmp_path, {1}, fenced)
    controller._lose(0, "n0-a0", "did not report within 30 s")
    assert fenced == ["n0-a0"]
    assert controller.migration.fenced == {0: "n0-a0 did not report within 30 s"}


def test_silent_ranks_that_are_the_fault_are_not_counted_as_survivors(tmp_path: Path) -> None:
    """A stall found by the hang timeout: nobody failed before; the silent ranks are the fault, two of them too."""
    fenced: list[str] = []
    controller = _controller_in_migration(tmp_path, set(), fenced)
    for rank in (2, 3):
        controller._lose(rank, f"n0-a{rank}", "did not report within 30 s")
        controller.migration.failed.add(rank)  # as _collect does after fencing
    assert fenced == ["n0-a2", "n0-a3"]
    assert controller.migration.fenced == {}


def test_a_status_written_by_a_stale_process_is_ignored(tmp_path: Path) -> None:
    """Rank 2's record comes from a process that is no longer its member (its node was declared lost)."""
    from torchpass.core.control import Status, put, put_counted

    controller = _controller_in_migration(tmp_path, {1}, [])
    store = controller.store
    for rank in (0, 2, 3):
        wid = "n1-a0" if rank == 2 else f"n0-a{rank}"
        put_counted(store, 0, "status", Keys.status(0, rank), Status(rank, wid, 4, True, 5, ["127.0.0.1", 1]))
    controller._collect(controller.migration)
    assert controller.migration.plan is None, "planned on a stale process's record"
    assert not store.check([Keys.status(0, 2)]), "the stale record was left where the member's belongs"
    bad = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert any(e["type"] == "bad_record" and "stale process" in e["message"] for e in bad), bad
    put(store, Keys.status(0, 2), Status(2, "n0-a2", 4, True, 5, ["127.0.0.1", 1]))
    controller._collect(controller.migration)
    # The member's own record is taken: the controller plans (and, with no spare in this job, says so).
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert sum(e["type"] == "bad_record" for e in events) == 1, events
    assert store.check([Keys.status(0, 2)])


def test_a_rank_lost_after_others_finished_training_ends_the_job_without_a_migration(tmp_path: Path) -> None:
    """Ranks 0, 1 and 3 ran the last step and exited; rank 2 dies before it exits: no spare has a step to run."""
    said: list[str] = []
    store = _store()
    spec = JobSpec(world_size=4, nnodes=1, nproc_per_node=4, spares_per_node=1, run_id="t", command=["train.py"])
    controller = Controller(store, spec, tmp_path, TorchPassConfig(), said.append, lambda node, order: None, "127.0.0.1:0")
    box = Mailbox(store, Keys.events)
    for r in range(4):
        box.post(Report("spawned", f"n0-a{r}", 0, r, detail={"pid": 100 + r, "role": "active"}))
    for r in (0, 1, 3):
        box.post(Report("exit", f"n0-a{r}", 0, r, detail={"exitcode": 0, "how": "exited with code 0"}))
    controller.tick()
    assert controller.outcome is None
    box.post(Report("exit", "n0-a2", 0, 2, detail={"exitcode": -9, "how": "was killed by SIGKILL"}))
    controller.tick()
    assert controller.migration is None
    assert controller.outcome == (0, "training completed; rank(s) [2] were lost after it ended")
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["type"] for e in events if e["type"] in ("lost_after_training", "migration")] == ["lost_after_training"]
