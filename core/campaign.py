"""``torchpass chaos``: a campaign of real faults against a job you name, each run checked bit for bit.

The driver runs your job once without faults, then ``faults`` times with one
real fault each, drawn from a seeded generator: its kind, the rank it hits and
the step at which it lands. It judges every faulted run against the fault-free
one and prints a table.

Fault kinds (see ``KINDS``): ``kill`` (SIGKILL), ``hang`` (SIGSTOP: only the
heartbeat timeout sees it), ``term`` (SIGTERM: a planned drain), ``node`` (a
whole node's launcher and processes, SIGKILL; needs ``nodes >= 2`` and never
hits node 0, whose loss stops the job), ``spare`` (SIGKILL of a rank, then of
the spare assigned to replace it while it joins) and ``double`` (SIGKILL of a
rank, then of a second rank while the first migration is under way).

A run is judged:

* **resolved**: the job exits 0; every rank's final state (all state classes,
  RNG streams, data position, buffers: ``telemetry.final_digest``) equals the
  fault-free run's bit for bit; every process not hit kept its PID; the ledger
  records the migrations as successful, costing no survivor;
* **disqualified**: the job stopped with a ledger entry that classes the fault
  disqualifying and names why (no spare left, no surviving copy, a bug in the
  script): a clean refusal;
* **hang**: the job did not finish within ``job_timeout_s``;
* **wrong state**: the job exited 0 but some rank's state differs (the worst
  outcome: training went on from the wrong state), or it stopped after a fault
  the ledger calls qualifying, or a survivor was fenced or replaced;
* **void**: the fault never landed (the driver, which reads a rank's step from
  its heartbeat, saw the job end first) and the job finished exactly as the
  fault-free run did: the run says nothing about migration and counts neither
  way. Ended before the fault with any other outcome, it is a hang or a wrong
  state.

Each run works in a fresh directory of its own (a job's relative outputs, such
as checkpoints, never leak from one run into the next); launch arguments that
name existing relative files are made absolute first.

Requirements on the job: it is deterministic given its seeds (the fault-free
run twice gives the same digests; the driver checks this when asked with
``check_determinism``), it runs long enough for ``first_step`` to
``steps - last_margin`` to be a range, and the launch arguments give it at
least as many spares as the kinds need (``spare`` and ``double`` need two).
"""

from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .inject import inject
from .job_secret import SECRET_ENV, for_operator
from .status import read_workers
from .free_port import free_port

__all__ = ["CampaignConfig", "KINDS", "FaultRun", "absolute_paths", "run_campaign", "format_summary", "load_campaign"]

KINDS = ("kill", "hang", "term", "node", "spare", "double")
"""The fault kinds a campaign draws from (see the module docstring)."""

RESOLVED, DISQUALIFIED, HANG, WRONG, VOID = "resolved", "disqualified", "hang", "wrong state", "void"


@dataclass
class CampaignConfig:
    """A fault campaign (``configs/chaos/campaign/*.yaml``; every field can be overridden with ``--set``)."""

    faults: int = 10
    """Faulted runs (one fault each, two for ``spare`` and ``double``). Each costs about one run of the job."""

    kinds: list[str] = field(default_factory=lambda: ["kill", "hang", "term", "spare", "double"])
    """Kinds drawn uniformly; ``node`` is left out of the default because it needs ``nodes >= 2``."""

    seed: int = 0
    """Seeds the draws: the same seed replays the same campaign."""

    nodes: int = 1
    """Launchers started on this machine, one per simulated node (``--nnodes``/``--node-rank``)."""

    first_step: int = 2
    """The earliest step a fault lands in; step 1 includes the job's warm-up collectives."""

    last_margin: int = 2
    """Faults land at least this many steps before the job's last step, so the migration has a step to resume."""

    job_timeout_s: float = 600.0
    """A run that has not finished after this long is a hang; it is killed and the campaign goes on."""

    second_fault_delay_s: float = 0.0
    """``double``: how long after the migration starts the second rank is killed (0: as soon as it is seen)."""

    check_determinism: bool = False
    """Run the fault-free job twice first and stop if the two disagree: a campaign on a job that is not
    deterministic would report every run as a wrong state."""

    run_dir: str = "torchpass_chaos"
    """Where every run's directory and the summary (``summary.json``) go; emptied first."""


def load_campaign(name: str, overrides: list[str]) -> CampaignConfig:
    """Compose ``configs/chaos/campaign/<name>.yaml`` (or a YAML path) with Hydra, type-checked against :class:`CampaignConfig`."""
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    ConfigStore.instance().store(name="campaign_schema", node=CampaignConfig)
    path = Path(name) if name.endswith((".yaml", ".yml")) else _campaign_dir() / f"{name}.yaml"
    if not path.is_file():
        names = sorted(p.stem for p in _campaign_dir().glob("*.yaml"))
        raise ValueError(f"campaign {name!r} not found; shipped campaigns: {', '.join(names)}")
    with initialize_config_dir(config_dir=str(path.resolve().parent), version_base=None):
        cfg = compose(config_name=path.stem, overrides=overrides)
    config = OmegaConf.to_object(cfg)
    assert isinstance(config, CampaignConfig)
    bad = [k for k in config.kinds if k not in KINDS]
    if bad:
        raise ValueError(f"kinds: {bad} are not fault kinds; expected some of {list(KINDS)}")
    if "node" in config.kinds and config.nodes < 2:
        raise ValueError("kinds: 'node' needs nodes >= 2 (node 0 hosts the store and is never the one lost)")
    if config.faults < 0:
        raise ValueError(f"faults: got {config.faults}; expected an integer >= 0")
    return config


def _campaign_dir() -> Path:
    from .config import _presets_dir

    return _presets_dir().parent / "chaos" / "campaign"


@dataclass
class FaultRun:
    """One faulted run and its verdict."""

    index: int
    kind: str
    rank: int
    step: int
    verdict: str = ""
    reason: str = ""
    seconds: float = 0.0
    """Wall time of the run."""
    lost_s: float = 0.0
    """Time the migrations took (the ledger's totals): the training time the faults cost."""
    second_rank: int | None = None


class _Job:
    """One run of the job: ``nodes`` launchers on this machine, sharing a run dir."""

    def __init__(self, run_dir: Path, launch_args: list[str], nodes: int, final_digest: bool = True):
        self.run_dir = run_dir
        self._store: Any = None
        run_dir.mkdir(parents=True)
        # Its own working directory: a job writing relative paths (TorchTitan's dump folder and
        # checkpoints) must not find the files of the run before it.
        cwd = run_dir.parent / f"{run_dir.name}.cwd"
        cwd.mkdir()
        port = free_port()
        self.procs: list[subprocess.Popen] = []
        env = dict(os.environ)
        if nodes > 1 and SECRET_ENV not in env and "--secret-file" not in launch_args:
            # The simulated nodes share one secret, as a scheduler would hand it to every node.
            env[SECRET_ENV] = secrets.token_hex(32)
        self._secret_file = launch_args[launch_args.index("--secret-file") + 1] if "--secret-file" in launch_args else None
        self._secret = env.get(SECRET_ENV)
        for node in range(nodes):
            cmd = [
                sys.executable, "-m", "torchpass.core.cli", "launch", "--nnodes", str(nodes), "--node-rank", str(node),
                "--master-addr", "127.0.0.1", "--master-port", str(port), "--run-dir", str(run_dir), "--quiet",
                "--set", f"telemetry.final_digest={str(final_digest).lower()}", *launch_args,
            ]  # fmt: skip
            log = open(run_dir.parent / f"{run_dir.name}.launcher{node}.log", "w")
            self.procs.append(subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env))
            if node == 0:
                self._wait(lambda: (run_dir / "workers.json").exists(), 120, "the job's workers.json")
        self.t0 = time.monotonic()

    def _wait(self, cond: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if self.procs and self.procs[0].poll() is not None:
                raise _Ended(f"the job ended while waiting for {what}")
            if time.monotonic() > deadline:
                raise _Ended(f"waited {timeout:.0f} s for {what}")
            time.sleep(0.02)

    def workers(self) -> dict[str, Any]:
        return read_workers(self.run_dir)

    def store(self) -> Any:
        """A client of the job's store (the run's control plane), connected on first use."""
        if self._store is None:
            from .control import StoreAddress

            host, port = self.workers()["store"].rsplit(":", 1)
            secret = self._secret.encode() if self._secret else for_operator(self.run_dir, self._secret_file)
            self._store = StoreAddress(host, int(port), secret, etcd=self.workers().get("store_etcd")).connect(timeout=10.0)
        return self._store

    def step_of(self, rank: int) -> int:
        """The step the rank's worker is executing, from its heartbeat (0 before training)."""
        from .control import Heartbeat, Keys, try_get

        row = next((w for w in self.workers()["workers"] if w["rank"] == rank and w["role"] == "active"), None)
        if row is None:
            return 0
        hb = try_get(self.store(), Keys.heartbeat(row["wid"]), Heartbeat)
        return hb.step if hb is not None and hb.phase == "train" else 0

    def wait_step(self, rank: int, step: int) -> None:
        self._wait(lambda: self.step_of(rank) >= step, 300, f"rank {rank} to reach step {step}")

    def active(self) -> dict[int, dict[str, Any]]:
        """Rank -> its active worker's row of ``workers.json`` (wid, node, pid)."""
        return {w["rank"]: w for w in self.workers()["workers"] if w["role"] == "active"}

    def finish(self, timeout: float) -> int | None:
        """The node-0 launcher's exit code, or None if the job did not end in time (then it is killed)."""
        deadline = self.t0 + timeout
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill()
                return None
        return self.procs[0].returncode

    def kill(self) -> None:
        for w in self.workers().get("workers", []) if (self.run_dir / "workers.json").exists() else []:
            _signal(w["pid"], signal.SIGKILL)
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    def digests(self) -> dict[int, dict[str, Any]]:
        from .runtime import FINAL_DIGESTS

        return {int(f.stem[4:]): json.loads(f.read_text()) for f in (self.run_dir / FINAL_DIGESTS).glob("rank*.json")}

    def ledger(self) -> list[dict[str, Any]]:
        path = self.run_dir / "events.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


class _Ended(Exception):
    """The job ended (or stalled) before the fault could be injected."""


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass  # gone already


def _inject(job: _Job, run: FaultRun, config: CampaignConfig, rng: random.Random, world: int) -> None:
    """Land ``run``'s fault(s) in the running job."""
    from .control import Keys

    job.wait_step(run.rank, run.step)
    if run.kind in ("kill", "hang", "term", "node"):
        inject(job.run_dir, run.kind, rank=run.rank)
        return
    spares = [w["wid"] for w in job.workers()["workers"] if w["role"] == "spare"]
    inject(job.run_dir, "kill", rank=run.rank)
    if run.kind == "spare":
        # The spare given the rank, killed while it joins (before it reports ready, most of the time).
        def assigned() -> list[str]:
            return [w for w in spares if job.store().check([Keys.assign(w)])]

        job._wait(lambda: bool(assigned()), 120, f"a spare assigned to rank {run.rank}")
        inject(job.run_dir, "kill", wid=assigned()[0])
        return
    # double: a second rank while the migration runs (its first generation has ended).
    run.second_rank = rng.choice([r for r in range(world) if r != run.rank])
    job._wait(lambda: job.store().check([Keys.end(0)]), 120, "the migration to start")
    time.sleep(config.second_fault_delay_s)
    inject(job.run_dir, "kill", rank=run.second_rank)


def _judge(job: _Job, run: FaultRun, code: int | None, reference: dict[int, dict[str, Any]], before: dict[int, dict[str, Any]]) -> None:
    events = job.ledger()
    migrations = [e for e in events if e.get("type") == "migration"]
    run.lost_s = sum(float(m.get("timings", {}).get("total", 0.0)) for m in migrations if m.get("outcome") == "success")
    if code is None:
        run.verdict, run.reason = HANG, f"did not finish within the job timeout; see {job.run_dir}"
        return
    after_end = [e for e in events if e.get("type") == "lost_after_training"]
    if code == 0 and after_end and not migrations:
        # Detection outlasted the job (a slow fault kind near the last step): nothing was left to migrate.
        run.verdict, run.reason = DISQUALIFIED, f"the fault landed after training ended: {after_end[0].get('message', '')}"[:200]
        return
    disqualifying = [m for m in migrations if m.get("classification") == "disqualifying"]
    stopped = [e for e in events if e.get("type") == "job_failed"]
    if code != 0:
        if disqualifying:
            run.verdict, run.reason = DISQUALIFIED, disqualifying[-1].get("message", "")[:200]
        else:
            # The ledger called the fault qualifying (or said nothing): the job should have survived it.
            why = stopped[-1].get("message", "") if stopped else "no reason in the ledger"
            run.verdict, run.reason = WRONG, f"exit code {code} after a qualifying fault: {why}"[:200]
        return
    digests = job.digests()
    if sorted(digests) != sorted(reference):
        run.verdict, run.reason = WRONG, f"final digests from ranks {sorted(digests)}, expected {sorted(reference)}"
        return
    differs = _differing(digests, reference)
    if differs:
        run.verdict, run.reason = WRONG, f"ranks {differs}: final state differs from the fault-free run"
        return
    hit = {run.rank} | ({run.second_rank} if run.second_rank is not None else set())
    if run.kind == "node":
        lost_node = before[run.rank]["node"]
        hit |= {r for r, w in before.items() if w["node"] == lost_node}
    moved = [r for r, w in before.items() if r not in hit and digests[r]["pid"] != w["pid"]]
    if moved:
        run.verdict, run.reason = WRONG, f"survivor rank(s) {moved} changed PID: a fault cost more than the ranks it hit"
        return
    fenced = [m["fenced"] for m in migrations if m.get("fenced")]
    if fenced:
        run.verdict, run.reason = WRONG, f"a survivor was fenced: {fenced}"
        return
    if not any(m.get("outcome") == "success" for m in migrations):
        run.verdict, run.reason = WRONG, "the job finished but the ledger records no successful migration"
        return
    run.verdict = RESOLVED


def _differing(digests: dict[int, dict[str, Any]], reference: dict[int, dict[str, Any]]) -> list[int]:
    """Ranks whose final state digest differs from the fault-free run's (both hold every rank)."""
    return [r for r in reference if digests[r]["digest"] != reference[r]["digest"]]


def _judge_unlanded(job: _Job, run: FaultRun, code: int | None, reference: dict[int, dict[str, Any]], why: str) -> None:
    """The verdict of a run whose fault never landed: void only when the job finished as the fault-free run did."""
    digests = job.digests() if code == 0 else {}
    clean = sorted(digests) == sorted(reference) and not _differing(digests, reference)
    if code == 0 and clean and not [e for e in job.ledger() if e.get("type") == "migration"]:
        run.verdict, run.reason = VOID, f"the fault never landed: {why}; the job finished as the fault-free run did"
        return
    # The job ended, stalled or went wrong on its own, before any fault: that is its failure, not a pass.
    run.verdict = HANG if code is None else WRONG
    run.reason = f"before the fault landed: {why} (exit code {code})"


def absolute_paths(args: list[str], cwd: Path) -> list[str]:
    """``args`` with every argument (or ``--flag=value`` value) naming an existing relative file made absolute.

    Each run works in a directory of its own, so ``train.py`` or ``--config ./job.toml`` must not depend
    on it. Directories stay relative: an output folder (``--job.dump_folder .``) belongs to the run.
    """
    out = []
    for arg in args:
        flag, eq, value = arg.partition("=") if arg.startswith("--") else ("", "", arg)
        if value and not Path(value).is_absolute() and (cwd / value).is_file():
            value = str((cwd / value).resolve())
        out.append(f"{flag}{eq}{value}")
    return out


def run_campaign(config: CampaignConfig, launch_args: list[str], say: Callable[[str], None] = print) -> list[FaultRun]:
    """Run the campaign; returns every faulted run with its verdict (also written to ``summary.json``)."""
    launch_args = absolute_paths(launch_args, Path.cwd())
    root = Path(config.run_dir).resolve()
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    say(f"torchpass chaos: {config.faults} fault(s) of kinds {config.kinds}, seed {config.seed}; runs in {root}")
    references = []
    for i in range(2 if config.check_determinism else 1):
        ref = _Job(root / f"reference{i}", launch_args, config.nodes)
        code = ref.finish(config.job_timeout_s)
        if code != 0:
            raise RuntimeError(f"the fault-free run failed (exit code {code}); see {ref.run_dir} and its launcher log")
        references.append(ref.digests())
    reference = references[0]
    if not reference:
        raise RuntimeError("the fault-free run wrote no final digests: does the job run under the torchpass runtime?")
    if any(r != {k: v["digest"] for k, v in reference.items()} for r in ({k: v["digest"] for k, v in d.items()} for d in references)):
        raise RuntimeError("two fault-free runs ended in different states: the job is not deterministic")
    world = len(reference)
    steps = min(d["version"] for d in reference.values())
    if steps - config.last_margin < config.first_step:
        raise RuntimeError(f"the job runs {steps} steps: too few for faults between step {config.first_step} and {config.last_margin} before the end")
    say(f"fault-free run: {world} ranks, {steps} steps")
    rng = random.Random(config.seed)
    runs: list[FaultRun] = []
    for i in range(config.faults):
        kind = rng.choice(config.kinds)
        per_node = world // config.nodes
        candidates = list(range(per_node, world)) if kind == "node" else list(range(world))
        run = FaultRun(i, kind, rng.choice(candidates), rng.randint(config.first_step, steps - config.last_margin))
        t0 = time.monotonic()
        job = _Job(root / f"fault{i:03d}-{kind}", launch_args, config.nodes)
        try:
            job.wait_step(0, 1)
            before = job.active()
            _inject(job, run, config, rng, world)
            code = job.finish(config.job_timeout_s)
            _judge(job, run, code, reference, before)
        except _Ended as exc:
            code = job.finish(config.job_timeout_s)
            _judge_unlanded(job, run, code, reference, str(exc))
        run.seconds = time.monotonic() - t0
        second = f" then rank {run.second_rank}" if run.second_rank is not None else ""
        say(f"[{i + 1}/{config.faults}] {kind} rank {run.rank}{second} at step {run.step}: {run.verdict}"
            f"{' (' + run.reason + ')' if run.reason else ''}, {run.seconds:.0f} s")  # fmt: skip
        runs.append(run)
        (root / "summary.json").write_text(json.dumps({"config": config.__dict__, "runs": [r.__dict__ for r in runs]}, indent=1))
    return runs


def format_summary(runs: list[FaultRun]) -> str:
    """The campaign's table: outcomes and time lost per fault kind, then every run that was not resolved."""
    voids = any(r.verdict == VOID for r in runs)
    head = "| kind | faults | resolved | disqualified | hangs | wrong state |" + (" void |" if voids else "")
    lines = [head + " time lost per fault (median, max) |", "|---" * (7 + voids) + "|"]
    for kind in [*KINDS, "all"]:
        rows = [r for r in runs if kind in ("all", r.kind)]
        if not rows:
            continue
        count = {v: sum(r.verdict == v for r in rows) for v in (RESOLVED, DISQUALIFIED, HANG, WRONG, VOID)}
        lost = [r.lost_s for r in rows if r.verdict == RESOLVED]
        spread = f"{statistics.median(lost):.2f} s, {max(lost):.2f} s" if lost else "-"
        void = f" {count[VOID]} |" if voids else ""
        lines.append(f"| {kind} | {len(rows)} | {count[RESOLVED]} | {count[DISQUALIFIED]} | {count[HANG]} | {count[WRONG]} |{void} {spread} |")
    bad = [r for r in runs if r.verdict != RESOLVED]
    if bad:
        lines.append("")
        lines += [f"- run {r.index} ({r.kind}, rank {r.rank}, step {r.step}): {r.verdict}: {r.reason}" for r in bad]
    return "\n".join(lines)
