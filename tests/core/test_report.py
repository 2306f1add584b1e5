"""``torchpass report``: headline figures computed from a hand-written ledger."""

from __future__ import annotations

import dataclasses
import json

import pytest

from torchpass.core import cli
from torchpass.core.ledger import DISQUALIFYING, QUALIFYING, JobEvent, Ledger, MigrationEvent, read_ledger
from torchpass.core.report import build_report, format_report, report_json


def migration(generation: int, outcome: str, classification: str = QUALIFYING, total: float = 0.0, **kw) -> dict:
    event = MigrationEvent(
        generation=generation,
        cause=kw.pop("cause", "kill"),
        classification=classification,
        outcome=outcome,
        failed_ranks=kw.pop("failed_ranks", [1]),
        replaced=kw.pop("replaced", {"1": "n0-s0"}),
        target_step=kw.pop("target_step", 5),
        bytes_moved=kw.pop("bytes_moved", 0),
        timings={"detect": 0.25, "transfer": 0.5, "total": total} if total else {},
        message=kw.pop("message", ""),
        t=1000.0 + generation,
        **kw,
    )
    return dataclasses.asdict(event)


def job(kind: str, message: str, **detail) -> dict:
    return dataclasses.asdict(JobEvent(kind, message, detail, t=999.0))


def write_lines(run_dir, events: list[dict], tail: str = "") -> None:
    text = "".join(json.dumps(e, sort_keys=True) + "\n" for e in events)
    (run_dir / "events.jsonl").write_text(text + tail)


def sample_events() -> list[dict]:
    return [
        job("job_start", "started", world_size=4, nnodes=2),
        migration(1, "superseded", total=1.0, bytes_moved=10),
        migration(2, "success", total=2.5, bytes_moved=3_000_000, failed_ranks=[1, 2], target_step=8),
        migration(3, "failed", DISQUALIFYING, total=0.75, cause="node", message="no spare left for rank(s) [3]"),
        job("job_end", "finished 20 steps", exit_code=0),
    ]


def test_build_report_counts_and_rates(tmp_path):
    write_lines(tmp_path, sample_events())
    rep = build_report(tmp_path)
    assert rep.job == {"world_size": 4, "nnodes": 2}
    assert rep.ended == "finished 20 steps"
    assert rep.exit_code == 0
    assert rep.qualifying == 1 and rep.qualifying_succeeded == 1
    assert rep.success_rate == 1.0
    assert rep.disqualifying == 1
    assert rep.superseded_attempts == 1
    assert rep.time_lost_s == pytest.approx(3.25)  # superseded attempts are not counted twice
    assert rep.bytes_moved == 3_000_000
    assert [i["generation"] for i in rep.incidents] == [2, 3]
    assert rep.incidents[0]["failed_ranks"] == [1, 2]
    assert rep.incidents[0]["resumed_at_step"] == 8
    assert rep.incidents[1]["class"] == DISQUALIFYING
    assert rep.incidents[1]["message"] == "no spare left for rank(s) [3]"


def test_failed_qualifying_migration_lowers_the_success_rate(tmp_path):
    events = [
        job("job_start", "started", world_size=2, nnodes=1),
        migration(1, "success", total=1.0),
        migration(2, "failed", total=1.0),
        migration(3, "success", total=1.0),
        job("job_failed", "cannot migrate"),
    ]
    write_lines(tmp_path, events)
    rep = build_report(tmp_path)
    assert rep.qualifying == 3 and rep.qualifying_succeeded == 2
    assert rep.success_rate == pytest.approx(2 / 3)
    assert rep.ended == "cannot migrate"
    assert rep.exit_code is None
    assert "67% (2/3)" in format_report(rep)


def test_format_report_contains_the_figures(tmp_path):
    write_lines(tmp_path, sample_events())
    text = format_report(build_report(tmp_path))
    assert f"run {tmp_path}" in text
    assert "4 ranks on 2 node(s); finished 20 steps" in text
    assert "success rate (qualifying migrations): 100% (1/1)" in text
    assert "disqualifying events: 1; attempts superseded by a further fault: 1" in text
    assert "time lost: 3.25 s in total; state moved: 3.0 MB" in text
    lines = text.splitlines()
    row = next(ln for ln in lines if ln.strip().startswith("2 "))
    assert "kill" in row and "success" in row and "1,2" in row and "2.50" in row and "transfer=0.50" in row
    assert "total=" not in row
    assert any(ln.strip().startswith("3 ") and "node" in ln and "failed" in ln for ln in lines)


def test_report_without_qualifying_failures(tmp_path):
    write_lines(tmp_path, [job("job_start", "started", world_size=2, nnodes=1)])
    rep = build_report(tmp_path)
    assert rep.success_rate is None
    assert rep.ended == "running (no job_end event yet)"
    text = format_report(rep)
    assert "n/a (no qualifying failure)" in text
    assert "gen" not in text  # no incident table


def test_report_json_is_the_report_as_data(tmp_path):
    write_lines(tmp_path, sample_events())
    data = json.loads(report_json(build_report(tmp_path)))
    assert data["success_rate"] == 1.0
    assert data["qualifying"] == 1 and data["disqualifying"] == 1 and data["superseded_attempts"] == 1
    assert data["time_lost_s"] == pytest.approx(3.25)
    assert len(data["incidents"]) == 2
    assert data["run_dir"] == str(tmp_path)


def test_torn_last_line_is_ignored(tmp_path):
    write_lines(tmp_path, sample_events()[:3], tail='{"type": "migration", "gener')
    rep = build_report(tmp_path)
    assert rep.qualifying == 1 and rep.superseded_attempts == 1
    assert len(list(read_ledger(tmp_path))) == 3


def test_a_torn_line_in_the_middle_is_an_error(tmp_path):
    events = sample_events()
    text = json.dumps(events[0]) + "\n" + '{"type": "migr' + "\n" + json.dumps(events[-1]) + "\n"
    (tmp_path / "events.jsonl").write_text(text)
    with pytest.raises(json.JSONDecodeError):
        build_report(tmp_path)


def test_blank_lines_are_skipped(tmp_path):
    write_lines(tmp_path, sample_events(), tail="\n\n")
    assert build_report(tmp_path).qualifying == 1


def test_missing_ledger_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"has no events\.jsonl; is it the --run-dir of a torchpass launch\?"):
        build_report(tmp_path)
    with pytest.raises(FileNotFoundError, match="no events.jsonl"):
        build_report(tmp_path / "does-not-exist")


def test_ledger_appends_what_the_report_reads(tmp_path):
    ledger = Ledger(tmp_path)
    ledger.append(JobEvent("job_start", "started", {"world_size": 2, "nnodes": 1}))
    ledger.append(MigrationEvent(1, "hang", QUALIFYING, "success", [0], {"0": "n0-s0"}, timings={"total": 1.5}))
    ledger.append(JobEvent("job_end", "done", {"exit_code": 0}))
    rep = build_report(tmp_path)
    assert rep.qualifying_succeeded == 1 and rep.time_lost_s == 1.5 and rep.exit_code == 0


def test_cli_report(tmp_path, capsys):
    write_lines(tmp_path, sample_events())
    cli.main(["report", "--run-dir", str(tmp_path)])
    assert "success rate (qualifying migrations): 100% (1/1)" in capsys.readouterr().out
    cli.main(["report", "--run-dir", str(tmp_path), "--json"])
    assert json.loads(capsys.readouterr().out)["success_rate"] == 1.0


def test_a_migration_that_fenced_a_survivor_is_listed_apart(tmp_path):
    fenced = {"0": "n0-a0 did not report within 30 s; alive, last seen in phase 'train' at step 4"}
    write_lines(
        tmp_path,
        [
            job("job_start", "started", world_size=4, nnodes=1),
            migration(1, "success", total=1.0, failed_ranks=[1]),
            migration(2, "success", total=31.0, failed_ranks=[2, 0], fenced=fenced),
            job("job_end", "finished", exit_code=0),
        ],
    )
    rep = build_report(tmp_path)
    assert rep.qualifying_succeeded == 2 and rep.succeeded_with_fencing == 1
    assert [inc["fenced"] for inc in rep.incidents] == [{}, fenced]
    text = format_report(rep)
    assert "of which 1 fenced a process besides the failed rank(s)" in text
    assert "fenced rank 0: n0-a0 did not report within 30 s" in text
    marked = [line for line in text.splitlines() if line.startswith(" *")]
    assert len(marked) == 1 and "success" in marked[0]


def test_a_ledger_written_before_fenced_was_recorded_still_reads(tmp_path):
    old = migration(1, "success", total=1.0)
    del old["fenced"]
    write_lines(tmp_path, [old])
    rep = build_report(tmp_path)
    assert rep.incidents[0]["fenced"] == {} and rep.succeeded_with_fencing == 0


def test_the_ranks_timers_are_reported(tmp_path):
    from torchpass.core.critical_path import CriticalPathTimers

    write_lines(tmp_path, sample_events())
    clock = [0.0]
    timers = CriticalPathTimers(lambda: clock[0])
    for step in (1, 2):
        timers.step_started(0, step, clock[0])
        clock[0] += 0.0002
        timers.add("backward", clock[0] - 0.0002)
        clock[0] += 0.0198
    timers.step_started(0, 3, clock[0])
    timers.write(tmp_path, 1)
    rep = build_report(tmp_path)
    assert rep.critical_path[0]["rank"] == 1 and round(rep.critical_path[0]["per_step_us"]["backward"]) == 200
    assert "rank 1: 200 us of a 20.0 ms step (1.00%) over 2 steps" in format_report(rep)
