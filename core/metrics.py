"""Prometheus metrics of a running job, served by node 0's launcher.

Turned on with ``metrics.port`` (off by default: an open port is the operator's
choice). The exposition is ``prometheus-client``'s own, on a registry of this
job alone; names follow Prometheus' conventions (base units, ``_total`` for
counters, ``_seconds``, ``_bytes``):

======================================================  =========  ===============================================
``torchpass_migrations_total{cause,classification,        counter    migration attempts by the ledger's cause,
outcome}``                                                           class and outcome (superseded ones included)
``torchpass_migration_success_ratio``                     gauge      successful qualifying / qualifying incidents,
                                                                     as ``torchpass report`` computes it
``torchpass_recovery_seconds{phase}``                     histogram  each successful migration's phases (detect,
                                                                     plan, spare_setup, transfer, rebuild, resume,
                                                                     total)
``torchpass_state_moved_bytes_total``                     counter    bytes of state the spares received
``torchpass_steps_lost_total``                            counter    completed steps rolled back
``torchpass_spares_free{node}``                           gauge      ready spares no rank was given, per node
``torchpass_node_heartbeat_age_seconds{node}``            gauge      how long each node's agent has not beaten
``torchpass_step``                                        gauge      the step rank 0 executes
``torchpass_step_seconds``                                gauge      the last step period rank 0 showed
``torchpass_generation``                                  gauge      the job's generation (one per migration)
``torchpass_migration_in_progress``                       gauge      1 while a migration runs
======================================================  =========  ===============================================

Counters move when the controller appends to the ledger (the same events
``torchpass report`` reads, counted by the same ``RunReport``); gauges are set
from the launcher's progress sample each second (``core/timeline.py``: what the
controller already tracks plus one store read, rank 0's heartbeat). A scrape reads only
these objects: it never touches the store or the controller.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from .ledger import JobEvent, MigrationEvent
from .report import RunReport
from .timeline import ProgressSample

if TYPE_CHECKING:
    from .controller import Controller

__all__ = ["JobMetrics", "RECOVERY_BUCKETS_S"]

RECOVERY_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
"""Histogram buckets for recovery phases: migrations measured here take 0.1-2 s, a large job's tens of seconds."""

class JobMetrics:
    """The job's metrics; :meth:`serve` exposes them over HTTP."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.migrations = Counter(
            "torchpass_migrations", "Migration attempts", ["cause", "classification", "outcome"], registry=r
        )
        self.success_ratio = Gauge(
            "torchpass_migration_success_ratio", "Successful qualifying migrations / qualifying migrations", registry=r
        )
        self.recovery = Histogram(
            "torchpass_recovery_seconds", "Seconds per phase of successful migrations", ["phase"], buckets=RECOVERY_BUCKETS_S, registry=r
        )
        self.bytes_moved = Counter("torchpass_state_moved_bytes", "Bytes of state moved to spares", registry=r)
        self.steps_lost = Counter("torchpass_steps_lost", "Completed steps rolled back by migrations", registry=r)
        self.spares_free = Gauge("torchpass_spares_free", "Ready spares not given a rank", ["node"], registry=r)
        self.node_heartbeat_age = Gauge(
            "torchpass_node_heartbeat_age_seconds", "Seconds since the node's agent last beat", ["node"], registry=r
        )
        self.step = Gauge("torchpass_step", "The step rank 0 executes", registry=r)
        self.step_seconds = Gauge("torchpass_step_seconds", "The last step period seen on rank 0", registry=r)
        self.generation = Gauge("torchpass_generation", "The job's generation", registry=r)
        self.in_progress = Gauge("torchpass_migration_in_progress", "1 while a migration runs", registry=r)
        self._report = RunReport("")
        self._seen_step: tuple[int, float] | None = None

    def serve(self, host: str, port: int) -> None:
        """Start the HTTP endpoint (a daemon thread of prometheus-client's)."""
        start_http_server(port, addr=host, registry=self.registry)

    def on_event(self, event: MigrationEvent | JobEvent) -> None:
        """Count a ledger event as the controller appends it."""
        ev = dataclasses.asdict(event)
        self._report.add(ev)
        if not isinstance(event, MigrationEvent):
            return
        self.migrations.labels(event.cause, event.classification, event.outcome).inc()
        if self._report.success_rate is not None:
            self.success_ratio.set(self._report.success_rate)
        if event.outcome == "success":
            for phase, seconds in event.timings.items():
                self.recovery.labels(phase).observe(seconds)
        self.bytes_moved.inc(event.bytes_moved)
        self.steps_lost.inc(event.steps_lost)

    def refresh(self, controller: Controller, sample: ProgressSample) -> None:
        """Bring the gauges up to date from the launcher's latest sample (``core/timeline.py``)."""
        for node, free in sample.spares_free.items():
            self.spares_free.labels(str(node)).set(free)
        for node, age in controller.node_heartbeat_ages.items():
            self.node_heartbeat_age.labels(str(node)).set(age)
        self.generation.set(sample.generation)
        self.in_progress.set(1 if sample.migrating else 0)
        if sample.step is not None:
            self._observe_step(sample.step, sample.t)

    def _observe_step(self, step: int, now: float) -> None:
        self.step.set(step)
        if self._seen_step is not None and step > self._seen_step[0]:
            self.step_seconds.set((now - self._seen_step[1]) / (step - self._seen_step[0]))
        if self._seen_step is None or step != self._seen_step[0]:
            self._seen_step = (step, now)
