"""``torchpass report --plot FILE.png``: the job's timeline as a picture.

Top: the step rank 0 executes over time (``timeline.jsonl``), each migration a
band from its fault to its resumed step, split into its phases (the ledger's
timings, in protocol order) and labelled with its cause. Bottom: the spares
free over time. Time runs from the job's start. matplotlib draws it (the
``plot`` extra); nothing else needs it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .ledger import read_ledger
from .timeline import read_timeline

__all__ = ["plot_run", "PHASE_COLORS"]

PHASE_COLORS = {
    "detect": "#d62728",
    "report_and_plan": "#ff7f0e",
    "spare_setup": "#bcbd22",
    "transfer": "#1f77b4",
    "rebuild": "#9467bd",
    "resume": "#2ca02c",
}
"""Protocol order and one colour each; the legend shows them."""


def plot_run(run_dir: str | Path, out: str | Path) -> Path:
    """Write the PNG; returns its path. Raises ``FileNotFoundError`` without a ledger, ``ImportError`` without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")  # a file, never a window: this runs on headless login nodes
    import matplotlib.pyplot as plt

    events = list(read_ledger(run_dir))
    if not events:
        raise FileNotFoundError(f"{run_dir} has no events.jsonl; is it the --run-dir of a torchpass launch?")
    samples = read_timeline(run_dir)
    t0 = min([e["t"] for e in events if e.get("type") == "job_start"] + [s["t"] for s in samples[:1]] or [events[0]["t"]])
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(10, 5.5), height_ratios=[3, 1], constrained_layout=True)
    stepped = [(s["t"] - t0, s["step"]) for s in samples if s["step"] is not None]
    if stepped:
        top.plot([t for t, _ in stepped], [s for _, s in stepped], color="black", linewidth=1.2, label="rank 0's step")
    for ev in (e for e in events if e.get("type") == "migration" and e["outcome"] != "superseded"):
        _draw_migration(top, ev, t0)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in PHASE_COLORS.values()]
    top.legend(handles, list(PHASE_COLORS), title="migration phases", loc="upper left", fontsize=8, title_fontsize=8)
    top.set_ylabel("step")
    top.set_title(f"torchpass job in {Path(run_dir).resolve()}: {_summary(events)}", fontsize=10)
    if samples:
        xs = [s["t"] - t0 for s in samples]
        ys = [sum(s["spares_free"].values()) for s in samples]
        bottom.step(xs, ys, where="post", color="#555555")
        bottom.set_ylim(-0.2, max(ys) + 0.8)
    bottom.set_ylabel("spares free")
    bottom.set_xlabel("seconds since the job started")
    path = Path(out)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _draw_migration(ax: Any, ev: dict[str, Any], t0: float) -> None:
    timings = ev.get("timings", {})
    total = float(timings.get("total", 0.0))
    start = ev["t"] - t0 - total
    at = start
    for phase, color in PHASE_COLORS.items():
        width = min(float(timings.get(phase, 0.0)), start + total - at)
        if width > 0:
            ax.axvspan(at, at + width, color=color, alpha=0.6, linewidth=0)
            at += width
    mark = "" if ev["outcome"] == "success" else f" ({ev['outcome']})"
    ax.annotate(f"{ev['cause']}{mark}\n{total:.2f} s", (start, 1.0), xycoords=("data", "axes fraction"), fontsize=7, va="top", ha="right", rotation=90)


def _summary(events: list[dict[str, Any]]) -> str:
    done = [e for e in events if e.get("type") == "migration" and e["outcome"] == "success"]
    return f"{len(done)} migration(s)" + (f", {sum(e['timings'].get('total', 0.0) for e in done):.2f} s in all" if done else "")
