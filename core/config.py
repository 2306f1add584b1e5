"""One configuration schema for every front end.

The DeepSpeed JSON block, the Megatron ``--torchpass-*`` flags, the TorchTitan
``[torchpass]`` TOML section and ``torchpass launch`` all map onto
:class:`TorchPassConfig`. Validation lives here and only here, so every front
end rejects bad input with the same message shape::

    torchpass config (DeepSpeed config block "torchpass"): heartbeat_timeout_s:
    got -1 (int); expected a number > 0

The schema is registered with Hydra's ConfigStore (group ``torchpass``) and the
YAML presets under ``torchpass/configs/torchpass/`` are validated against it.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, get_type_hints

from .checksum import CHUNK_BYTES

__all__ = [
    "ChaosConfig",
    "ConfigError",
    "MetricsConfig",
    "SignalsConfig",
    "TelemetryConfig",
    "TorchPassConfig",
    "load_preset",
    "parse_xids",
    "load_scenario",
    "config_from_mapping",
    "deep_merge",
    "preset_names",
    "register_with_hydra",
    "unknown_key_error",
]

REDUNDANCY_MODES = ("auto", "replica", "buddy")


class ConfigError(ValueError):
    """A configuration value was rejected; the message names the field, the value and what is valid."""


def unknown_key_error(source: str, prefix: str, key: str, valid: list[str]) -> ConfigError:
    """The error for a key no schema field has: names it, the closest valid key, and every valid key."""
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(f"{source}: unknown key {prefix}{key}{hint}; valid keys: {', '.join(sorted(valid))}")


def positive_int(value: str, name: str, words: tuple[str, ...] = ()) -> int:
    """A command-line count (``--nnodes``, ``--nproc-per-node``); ValueError naming ``name`` and what is valid
    (``words``: the names the flag also takes, which the caller handles)."""
    valid = "an integer >= 1" + "".join(f", {w!r}" for w in words)
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"{name}: got {value!r}; expected {valid}") from None
    if n < 1:
        raise ValueError(f"{name}: got {n}; expected {valid}")
    return n


def _positive(value: float) -> bool:
    return value > 0


def _non_negative(value: float) -> bool:
    return value >= 0


@dataclass
class TelemetryConfig:
    """What the runtime records besides the migration ledger, which is always written."""

    console: bool = True
    """Print one human-readable line per migration phase on the launcher's console. On by
    default because a migration is an operator-visible event; turn off for quiet CI logs."""

    final_digest: bool = False
    """Each rank writes a digest of its whole final state (every state class, its RNG streams,
    data position and buffers) to ``<run_dir>/final/rank<r>.json`` as it finishes, so two
    runs can be compared bit for bit (``torchpass chaos`` does). Off by default: it costs one
    state capture and a pass over its bytes at exit."""


LAUNCHER_SETTINGS = {
    "spares_per_node": "torchpass launch --spares-per-node N",
    "run_dir": "torchpass launch --run-dir DIR",
    "telemetry.console": "torchpass launch --set telemetry.console=false",
    "controller_lease_s": "torchpass launch --set controller_lease_s=N",
}
"""Settings ``torchpass launch`` reads before any worker reads a framework's config, and where to set them
instead: a framework's config block (DeepSpeed's, TorchTitan's) that names one is refused with this."""


SIGNAL_MODES = ("auto", "required", "disabled")
"""Words, not on/off: YAML reads an unquoted ``on`` or ``off`` as a boolean."""

CRITICAL_XIDS = "48,63,64,74,79,92,94,95,119,120"
"""XIDs that announce a failing GPU (NVIDIA's XID catalogue): 48 double-bit ECC, 63/64 row remapping
event/failure, 74 NVLink error, 79 fallen off the bus, 92 high single-bit ECC rate, 94/95 contained/uncontained
ECC error, 119/120 GSP errors. Application faults (13, 31, 43) are left out: they are the script's, and a
spare would repeat them."""


def parse_xids(text: str) -> frozenset[int]:
    """``"48, 79"`` -> ``{48, 79}`` (``signals.xids``); raises ``ValueError`` naming the bad entry."""
    out = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        if not part.isdigit():
            raise ValueError(f"{part!r} is not an XID number")
        out.add(int(part))
    return frozenset(out)


def _xid_list(text: str) -> bool:
    try:
        parse_xids(text)
    except ValueError:
        return False
    return True


@dataclass
class SignalsConfig:
    """Early notice that a node or a GPU goes away (a scheduler, NVML), turned into planned migrations
    (``core/node_signals.py``)."""

    slurm: str = field(default="auto", metadata={"choices": SIGNAL_MODES})
    """Watch this node's Slurm state (DRAIN, FAIL, maintenance). ``auto``: when the launcher runs inside a Slurm
    job (``SLURM_JOB_ID`` set) and Slurm's client commands are on PATH, so Slurm users get it without asking;
    ``required``: always, and the launch fails if Slurm's commands are missing; ``disabled``: never."""

    poll_interval_s: float = field(default=5.0, metadata={"check": (_positive, "a number > 0")})
    """Seconds between two looks at the scheduler, per node. A drain gives minutes of notice and a migration
    takes seconds, so 5 s loses nothing; it costs slurmctld one RPC per node per interval (200/s at 1,000 nodes,
    well within what slurmctld serves)."""

    maint_lead_s: float = field(default=900.0, metadata={"check": (_non_negative, "a number >= 0")})
    """A maintenance reservation on this node that starts within this many seconds drains it now. 15 minutes
    covers a migration of any size with a wide margin and keeps the node in use until shortly before."""

    nvml: str = field(default="auto", metadata={"choices": SIGNAL_MODES})
    """Watch each slot's GPU through NVML (``core/gpu_health.py``). ``auto``: when NVML starts and sees a GPU
    (a CPU machine says so once and goes on); ``required``: the launch fails without it; ``disabled``: never."""

    ecc_uncorrected_increase: int = field(default=1, metadata={"check": (_positive, "an integer >= 1")})
    """New volatile uncorrectable ECC errors on a GPU that move its rank. One: each is data already lost or
    about to be, and the page goes to retirement."""

    thermal_margin_c: float = field(default=5.0, metadata={"check": (_non_negative, "a number >= 0")})
    """A GPU this many degrees C from its slowdown threshold moves its rank: close enough that it is in
    trouble (cooling failed), far enough that it has not yet slowed the whole job down."""

    xids: str = field(default=CRITICAL_XIDS, metadata={"check": (_xid_list, "comma-separated XID numbers")})
    """Critical XIDs that move the rank of the GPU reporting one; empty for none."""

    k8s: str = field(default="auto", metadata={"choices": SIGNAL_MODES})
    """Watch this node and the job's pods on it in Kubernetes (``core/kubernetes_signals.py``). ``auto``: when
    the launcher runs in a pod and the ``kubernetes`` client is installed; ``required``: the launch fails
    without them; ``disabled``: never."""

    k8s_node: str = ""
    """The Kubernetes node this launcher runs on; empty: the ``NODE_NAME`` environment variable, which a pod
    spec sets from the downward API (``fieldRef: spec.nodeName``)."""

    k8s_namespace: str = ""
    """Namespace of the job's pods; empty: the pod's own (in a cluster), else ``default``."""

    k8s_pod_selector: str = ""
    """Label selector of the job's pods (``job=llm``); one on this node being deleted drains the node. Empty:
    only this launcher's own pod (``POD_NAME``, else the host name, which Kubernetes sets to the pod's)."""

    k8s_taints: str = "ToBeDeletedByClusterAutoscaler,node.kubernetes.io/out-of-service"
    """Comma-separated taint keys that drain the node: the cluster autoscaler's mark on a node it is about to
    remove, and the out-of-service taint an operator sets on a node going down. A cordon always drains."""

    k8s_kubeconfig: str = ""
    """The kubeconfig to use outside a cluster; empty: in-cluster credentials in a pod, else ``$KUBECONFIG`` or
    ``~/.kube/config``."""


@dataclass
class MetricsConfig:
    """The Prometheus endpoint node 0's launcher serves (``core/metrics.py``)."""

    port: int = field(default=0, metadata={"check": (lambda v: 0 <= v <= 65535, "a port 1-65535, or 0 for off")})
    """Port of the ``/metrics`` endpoint; 0 (the default) serves none: opening a port is the operator's call.
    9400 is free of the well-known exporters' ports."""

    host: str = "0.0.0.0"
    """Address the endpoint listens on. Every interface, as exporters do, since Prometheus scrapes from
    another host; the figures carry no secret, but keep the port to the monitoring network."""


CHAOS_POINTS = ("attach", "step_start", "last_forward", "backward", "commit", "after_commit", "step_end")
CHAOS_ACTIONS = ("kill", "stall", "term")


@dataclass
class ChaosConfig:
    """A deterministic fault at a precise point of the step protocol, on one rank.

    ``torchpass inject`` lands faults at wall-clock moments; this lands them at a
    protocol point (inside the optimizer step, say), to test the hardest cases on
    your own workload. It fires once, in the process first started for that rank,
    never in the spare that replaces it.
    """

    action: str = field(default="kill", metadata={"choices": CHAOS_ACTIONS})
    """``kill``: SIGKILL the process. ``stall``: its training thread stops forever while its heartbeat
    thread goes on, as a rank wedged in a kernel or a deadlock would; only the hang timeout catches it.
    ``term``: SIGTERM to itself, a drain asked for at that exact point; the rank is held there until
    the drain ends its generation, so every rank is caught at that point."""

    kill_rank: int = field(default=-1, metadata={"check": (lambda v: v >= -1, "an integer >= -1 (-1: off)")})
    """The global rank to hit; -1 turns chaos off (the default)."""

    kill_step: int = field(default=0, metadata={"check": (_non_negative, "an integer >= 0")})
    """The step during which to hit it."""

    kill_point: str = field(default="commit", metadata={"choices": CHAOS_POINTS})
    """``attach`` (start-up: the rank reported its layout, its peers wait for its buddy address; ``kill_step``
    is then the first step), ``step_start``, ``last_forward`` (the forward of the step's last micro-batch
    began; adapters that see each forward call: DeepSpeed's unchanged loops), ``backward`` (the backward pass
    began), ``commit`` (inside the optimizer step, before it changes anything), ``after_commit`` (the
    optimizer step finished, the step did not) or ``step_end`` (the step returned to the training loop,
    its buddy copy not yet sent: the others fail in the loop's own code between steps). A point that never
    came by the end of ``kill_step`` (one the training loop does not report) fails the rank, naming it,
    rather than leave a fault test passing with no fault injected."""


@dataclass
class TorchPassConfig:
    """Live-migration settings shared by the launcher, the runtime and every adapter."""

    enabled: bool = True
    """With False the framework runs exactly as without torchpass: no hooks, no mirrors."""

    spares_per_node: int = field(default=1, metadata={"check": (_non_negative, "an integer >= 0")})
    """Hot spares ``torchpass launch`` starts on each node when ``--spares-per-node`` is not
    given. One per node covers any single-process failure on that node; a whole-node loss
    needs spares on the other nodes, one per lost rank."""

    run_dir: str = "torchpass_run"
    """Where ``torchpass launch`` writes ``workers.json``, ``events.jsonl`` and worker logs
    when ``--run-dir`` is not given. Relative to the launcher's working directory."""

    heartbeat_interval_s: float = field(default=1.0, metadata={"check": (_positive, "a number > 0")})
    """How often each worker's heartbeat thread writes its liveness record. Bounds the
    staleness of ``torchpass status``; costs one store write per interval per worker."""

    heartbeat_timeout_s: float = field(default=10.0, metadata={"check": (_positive, "a number > 0")})
    """A worker whose heartbeat is older than this, and whose CPU time has stood still as long
    (its agent reads it from /proc), is declared hung (e.g. SIGSTOP, a wedged host) and is
    fenced and replaced. This, not the process-group timeout, bounds hang
    recovery. Must exceed ``heartbeat_interval_s``; 10 s tolerates scheduler hiccups."""

    hang_timeout_s: float = field(default=900.0, metadata={"check": (_positive, "a number > 0")})
    """No rank finishing a step for this long is treated as a stuck collective: the
    generation is ended and ranks that cannot report are replaced. Must exceed the longest
    legitimate step (first-step compilation, evaluation inside a step)."""

    report_timeout_s: float = field(default=30.0, metadata={"check": (_positive, "a number > 0")})
    """After a failure, how long the controller waits for survivors to report their state
    before treating a silent one as failed too (a second fault during the migration)."""

    store_timeout_s: float = field(default=0.0, metadata={"check": (_non_negative, "a number >= 0 (0: automatic)")})
    """How long a worker or launcher goes without completing a store operation before it
    concludes node 0 (store and controller) is gone and exits, a launcher killing its workers
    first. Bounds the time from node 0's loss to every process of the job gone. 0 (the default)
    means three times ``heartbeat_timeout_s`` and at least 30 s: a store busy with a large
    migration is ridden out, a job that raised its heartbeat timeout for long stalls keeps that
    tolerance, and a dead job's processes do not hold their devices for minutes. Set, it must
    exceed ``heartbeat_timeout_s`` (a stall that long gets a node declared lost first)."""

    controller_lease_s: int = field(default=5, metadata={"check": (_positive, "an integer >= 1")})
    """On an etcd store (``--store etcd://``), how long the job goes without a controller after the
    launcher running it dies or is cut off, before another launcher takes over (its etcd lease's TTL,
    renewed every third of it). etcd grants at least its own minimum (about 2 s with its default
    election timeout). 5 s: a launcher paused for less (a slow disk, a busy host) keeps the
    controller, and a take-over costs less than one heartbeat timeout more than a node's loss."""

    rebuild_timeout_s: float = field(default=120.0, metadata={"check": (_positive, "a number > 0")})
    """Bound on building one generation's communicators. A member that dies mid-rebuild is
    detected by this timeout, so keep it well under the job's process-group timeout."""

    spare_join_timeout_s: float = field(default=300.0, metadata={"check": (_positive, "a number > 0")})
    """How long survivors wait for an assigned spare to run the training script up to its
    first step (model and optimizer construction) before picking another spare."""

    spare_start_timeout_s: float = field(default=180.0, metadata={"check": (_positive, "a number > 0")})
    """How long a migration that finds no ready spare waits for spares that are still starting
    (spawned, importing the framework, not yet reported ready) before it stops the job as
    "no spare left". Spares start with the job, and on a cold machine importing DeepSpeed or
    TorchTitan takes tens of seconds: a fault in that window should wait for them, not end the job."""

    comm_failures_per_step: int = field(default=3, metadata={"check": (_positive, "an integer >= 1")})
    """How many migrations in a row may resume at the same step with no process lost before the job
    stops as a bug in the training script. A collective error that repeats deterministically (mismatched
    shapes, a script's exception whose text mentions gloo) would otherwise re-plan forever; 3 leaves room
    for a transient network error to recur once."""

    redundancy: str = field(default="auto", metadata={"choices": REDUNDANCY_MODES})
    """Where a lost rank's state comes from. ``replica``: only from data-parallel replicas
    (sharded state without a replica makes the event disqualifying). ``buddy``: keep an
    in-memory copy of every rank's unique state on a rank of another node, refreshed every
    ``buddy_interval_steps``. ``auto``: replicas where the layout has them, buddy copies for
    the rest."""

    buddy_interval_steps: int = field(default=1, metadata={"check": (_positive, "an integer >= 1")})
    """Refresh period of buddy copies, in optimizer steps. A recovery that needs a buddy copy
    rolls back at most this many steps; larger values trade recompute for copy traffic."""

    transfer_chunk_bytes: int = field(
        default=CHUNK_BYTES, metadata={"check": (lambda v: 64 << 10 <= v <= 1 << 30, "an integer in [65536, 1073741824]")}
    )
    """Size of one checksummed transfer chunk. 4 MiB keeps the checksum cost hidden behind
    the socket while a corrupted chunk costs little to resend."""

    transfer_retries: int = field(default=3, metadata={"check": (_non_negative, "an integer >= 0")})
    """How many times a chunk whose checksum does not match is re-requested before the
    transfer (and that migration attempt) fails. A spare never resumes on unverified state."""

    verify_replicas: bool = True
    """Before copying from several data-parallel replicas, check their state fingerprints
    agree. Catches silent divergence at the cost of hashing the state once per migration."""

    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    """Optional records beyond the ledger."""

    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """The job's Prometheus endpoint, served by node 0's launcher (read by ``torchpass launch``)."""

    signals: SignalsConfig = field(default_factory=SignalsConfig)
    """Schedulers' early signals that start planned migrations. Read by ``torchpass launch`` (``--config``,
    ``--set signals.*``) before the script starts, like ``spares_per_node``."""

    chaos: ChaosConfig = field(default_factory=ChaosConfig)
    """Deterministic fault injection for testing (off by default)."""

    def validate(self, source: str = "torchpass config") -> "TorchPassConfig":
        """Check cross-field constraints; raise :class:`ConfigError` naming the fields."""
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ConfigError(
                f"{source}: heartbeat_timeout_s: got {self.heartbeat_timeout_s!r}; expected a number greater than "
                f"heartbeat_interval_s ({self.heartbeat_interval_s!r}), or every worker would look hung"
            )
        if self.store_timeout_s and self.store_timeout_s <= self.heartbeat_timeout_s:
            raise ConfigError(
                f"{source}: store_timeout_s: got {self.store_timeout_s!r}; expected a number greater than "
                f"heartbeat_timeout_s ({self.heartbeat_timeout_s!r}), or a store hiccup would end processes "
                "before any node is declared lost"
            )
        return self

    def store_bound_s(self) -> float:
        """The store watchdog's bound: ``store_timeout_s``, or its automatic value when that is 0."""
        return self.store_timeout_s or max(30.0, 3 * self.heartbeat_timeout_s)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check_scalar(path: str, value: Any, expected: type, meta: Mapping[str, Any], source: str) -> Any:
    """Coerce and validate one leaf value. Ints are accepted for float fields; nothing else is coerced."""
    type_name = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}[expected]
    accepted = (int, float) if expected is float else (expected,)
    # bool is an int subclass: `true` must not pass for a count, nor 1 for a switch.
    if isinstance(value, bool) != (expected is bool) or not isinstance(value, accepted):
        raise ConfigError(f"{source}: {path}: got {value!r} ({type(value).__name__}); expected {type_name}")
    if expected is float:
        value = float(value)
    if "choices" in meta and value not in meta["choices"]:
        raise ConfigError(f"{source}: {path}: got {value!r}; expected one of {', '.join(map(repr, meta['choices']))}")
    if "check" in meta:
        check, description = meta["check"]
        if not check(value):
            raise ConfigError(f"{source}: {path}: got {value!r}; expected {description}")
    return value


def _build(cls: type, data: Mapping[str, Any], prefix: str, source: str) -> Any:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: {prefix.rstrip('.') or 'torchpass'}: got {data!r}; expected a mapping of fields")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in fields:
            raise unknown_key_error(source, prefix, str(key), list(fields))
        expected = hints[key]
        if dataclasses.is_dataclass(expected):
            kwargs[key] = _build(expected, value, f"{prefix}{key}.", source)
        else:
            kwargs[key] = _check_scalar(f"{prefix}{key}", value, expected, fields[key].metadata, source)
    return cls(**kwargs)


def config_from_mapping(data: Mapping[str, Any] | None, source: str = "torchpass config") -> TorchPassConfig:
    """Build a validated config from a plain mapping (a JSON block, a TOML table, parsed flags).

    ``source`` names where the mapping came from so the error points the user at the right file.
    """
    config = _build(TorchPassConfig, dict(data or {}), "", source)
    return config.validate(source)


def _presets_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "configs" / "torchpass"


def preset_names() -> list[str]:
    """Names of the YAML presets shipped under ``torchpass/configs/torchpass``."""
    return sorted(p.stem for p in _presets_dir().glob("*.yaml"))


def load_preset(name: str, overrides: Mapping[str, Any] | None = None) -> TorchPassConfig:
    """Load a shipped preset by name (or a YAML path) and apply ``overrides`` on top."""
    from omegaconf import OmegaConf

    path = Path(name) if name.endswith((".yaml", ".yml")) else _presets_dir() / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"torchpass preset {name!r} not found; available presets: {', '.join(preset_names())}")
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True) or {}
    raw.pop("defaults", None)
    merged = deep_merge(raw, dict(overrides or {}))
    return config_from_mapping(merged, source=f"torchpass preset {path.name}")


def load_scenario(group: str, name: str) -> dict[str, Any]:
    """A raw config fragment from ``configs/<group>/<name>.yaml`` (validated once merged into a config)."""
    from omegaconf import OmegaConf

    path = _presets_dir().parent / group / f"{name}.yaml"
    if not path.is_file():
        names = sorted(p.stem for p in path.parent.glob("*.yaml"))
        raise ConfigError(f"no {group} scenario {name!r}; available: {', '.join(names)}")
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True) or {}
    raw.pop("defaults", None)
    return raw


def deep_merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """``top`` over ``base``, merging nested mappings key by key."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(dict(out[key]), value)
        else:
            out[key] = value
    return out


def register_with_hydra() -> None:
    """Register the schema with Hydra's ConfigStore as ``torchpass/schema``.

    Presets declare ``defaults: [schema, _self_]`` so Hydra type-checks them against
    the dataclass when they are composed into an application's config.
    """
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(group="torchpass", name="schema", node=TorchPassConfig)


def config_from_env() -> TorchPassConfig:
    """The config a launcher handed to its workers (``TORCHPASS_CONFIG`` holds JSON)."""
    import json

    raw = os.environ.get("TORCHPASS_CONFIG")
    if not raw:
        return TorchPassConfig()
    return config_from_mapping(json.loads(raw), source="TORCHPASS_CONFIG (set by torchpass launch)")
