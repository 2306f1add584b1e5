"""The node-signal watcher: each source polled off the caller's thread, one signal per source, failures retried."""

from __future__ import annotations

import time

from torchpass.core.node_signals import NodeSignal, NodeSignalWatcher
from torchpass.core.slurm import parse_node_state, parse_reservations


class ScriptedSource:
    """A source whose answers a test writes: a list of signals, or an exception."""

    def __init__(self, name: str, answers: list) -> None:
        self.name = name
        self.answers = list(answers)
        self.polls = 0

    def poll(self) -> list[NodeSignal]:
        self.polls += 1
        answer = self.answers.pop(0) if self.answers else []
        if isinstance(answer, Exception):
            raise answer
        return answer


def _take_until(watcher: NodeSignalWatcher, n: int, timeout: float = 5.0) -> list:
    found: list = []
    deadline = time.time() + timeout
    while len(found) < n and time.time() < deadline:
        found += watcher.take()
        time.sleep(0.01)
    return found


def test_a_signal_is_taken_once_and_its_source_is_not_polled_again() -> None:
    drain = NodeSignal("slurm-drain", "bad DIMM", {"node": "n1"})
    source = ScriptedSource("slurm", [[], [drain]])
    said: list[str] = []
    watcher = NodeSignalWatcher([source], 0.01, said.append)
    watcher.start()
    assert _take_until(watcher, 1) == [("slurm", drain)]
    polls = source.polls
    time.sleep(0.1)
    watcher.stop()
    assert source.polls == polls and watcher.take() == []
    assert said == ["watching this node's scheduler state: slurm"]


def test_a_failing_source_is_logged_once_per_episode_and_retried() -> None:
    drain = NodeSignal("slurm-drain", "maintenance")
    source = ScriptedSource("slurm", [RuntimeError("slurmctld down"), RuntimeError("slurmctld down"), [], [drain]])
    said: list[str] = []
    watcher = NodeSignalWatcher([source], 0.01, said.append)
    watcher.start()
    assert _take_until(watcher, 1) == [("slurm", drain)]
    watcher.stop()
    assert said[1:] == ["cannot read this node's state from slurm (slurmctld down); retrying every poll", "slurm answers again"]


def test_a_gpu_signal_leaves_the_source_watching_the_other_gpus() -> None:
    gpu1 = NodeSignal("pre-emptive", "GPU 1: critical XID 79", {"signal": "xid", "value": 79, "gpu": 1}, gpu=1)
    gpu0 = NodeSignal("pre-emptive", "GPU 0: 93 C", {"signal": "thermal", "value": 93, "gpu": 0}, gpu=0)
    source = ScriptedSource("nvml", [[gpu1], [], [gpu0]])
    watcher = NodeSignalWatcher([source], 0.01, lambda line: None)
    watcher.start()
    assert _take_until(watcher, 2) == [("nvml", gpu1), ("nvml", gpu0)]
    watcher.stop()


def test_without_sources_nothing_runs() -> None:
    said: list[str] = []
    watcher = NodeSignalWatcher([], 0.01, said.append)
    watcher.start()
    assert said == [] and watcher.take() == []


def test_sinfo_state_lines_parse_into_flags_and_reason() -> None:
    # As sinfo 22.05 prints them with --Format StateComplete:|,Reason:512 (trailing padding included).
    assert parse_node_state("idle+drain|ECC errors on DIMM 3      ") == ({"idle", "drain"}, "ECC errors on DIMM 3")
    assert parse_node_state("mixed+drain|a|b   ") == ({"mixed", "drain"}, "a|b")
    assert parse_node_state("down*+fail|fan") == ({"down", "fail"}, "fan")
    assert parse_node_state("idle|none") == ({"idle"}, "")


def test_reservations_parse_from_scontrol_oneliners() -> None:
    text = (
        "ReservationName=firmware StartTime=2026-12-03T20:07:13 EndTime=2026-12-03T20:37:13 Duration=00:30:00 "
        "Nodes=tpnode-[a-b] NodeCnt=2 CoreCnt=4 Features=(null) PartitionName=(null) Flags=MAINT,SPEC_NODES "
        "TRES=cpu=4 Users=root Groups=(null) Accounts=(null) Licenses=(null) State=INACTIVE BurstBuffer=(null) "
        "Watts=n/a MaxStartDelay=(null)\n"
    )
    (res,) = parse_reservations(text)
    assert res["ReservationName"] == "firmware" and res["Flags"] == "MAINT,SPEC_NODES" and res["Nodes"] == "tpnode-[a-b]"
    assert parse_reservations("No reservations in the system\n") == []
