"""``torchpass launch``: torchrun's command line, plus hot spares and a run directory.

The launcher of node 0 hosts the control-plane ``TCPStore`` (also the
workers' ``env://`` rendezvous store, as torchrun's agent store is) and runs
the controller; every launcher runs its node's agent. On an etcd store the
controller runs in whichever launcher holds its lease (node 0's first), and
another launcher takes it over when that one is lost
(``core/controller_election.py``). Everything the user can
get wrong is checked before anything is started or written: the config, the
sizes, the script, the store address.
"""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import json
import os
import shutil
import signal
import socket
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from . import devices, job_secret, nccl_transport
from .agent import Agent, NodeSpec
from .gpu_health import GpuHealthSource, GpuThresholds, probe_nvml, gpu_handles
from .kubernetes_signals import KubernetesSource, default_namespace, in_cluster, kubernetes_available
from .metrics import JobMetrics
from .timeline import FILE as TIMELINE_FILE
from .timeline import SAMPLE_S, Timeline, take_sample
from .node_signals import NodeSignalSource, NodeSignalWatcher
from .slurm import SlurmDrainSource, slurm_available, slurm_node_name, slurm_placement
from .etcd_store import EtcdStore, GuardLost, job_url, parse_etcd_url, shown_url
from .controller_election import ControllerLease
from .config import ConfigError, TorchPassConfig, positive_int, config_from_mapping, deep_merge, load_preset, load_scenario, parse_xids
from .control import Keys, Mailbox, Report, signed
from .controller import Controller, JobSpec
from .liveness import STORE_LOST_EXIT
from .free_port import free_port

__all__ = ["add_launch_arguments", "launch", "LaunchError"]


class LaunchError(Exception):
    """A launch refused before anything started; the message names the cause."""


def add_launch_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("torchrun-compatible options")
    g.add_argument("--nnodes", default=None, help="number of nodes, or MIN:MAX with MIN == MAX (default: srun's step, else 1)")
    g.add_argument(
        "--nproc-per-node", "--nproc_per_node", default="1",
        help="active workers per node: an integer, 'gpu' (the GPUs the spares leave), 'cpu' or 'auto' (gpu, else cpu)",
    )
    g.add_argument("--node-rank", "--node_rank", type=int, default=None, help="this node's rank; node 0 hosts the store (default: srun's, else 0)")
    g.add_argument("--master-addr", "--master_addr", default=None, help="address of node 0 (default: srun's first node, else 127.0.0.1)")
    g.add_argument("--master-port", "--master_port", type=int, default=29500, help="port of the store on node 0")
    g.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default="", help="HOST:PORT of the store (overrides --master-*)")
    g.add_argument("--rdzv-backend", "--rdzv_backend", default="static", choices=("static", "c10d"))
    g.add_argument("--rdzv-id", "--rdzv_id", default="", help="a job id (recorded in the run directory)")
    g.add_argument("--rdzv-conf", "--rdzv_conf", default="", help="KEY=VALUE,...; join_timeout bounds reaching the store (s)")
    g.add_argument("--standalone", action="store_true", help="single node on a free local port")
    g.add_argument("--max-restarts", "--max_restarts", type=int, default=0, help="accepted for compatibility; torchpass migrates instead")
    g.add_argument("--monitor-interval", "--monitor_interval", type=float, default=0.05, help="seconds between agent ticks")
    g.add_argument("-m", "--module", action="store_true", help="run the training script as a module (python -m)")
    g.add_argument("--no-python", "--no_python", action="store_true", help="not supported: workers run Python")
    t = p.add_argument_group("torchpass options")
    t.add_argument(
        "--store",
        default="",
        help="the control plane's store: left out, a TCPStore node 0 hosts; etcd://HOST:PORT,... (etcds://...?cacert=F&cert=F&key=F "
        "for TLS) for an etcd cluster, whose keys the job keeps under /torchpass/<--rdzv-id>",
    )
    t.add_argument("--spares-per-node", "--spares_per_node", type=int, default=None, help="hot spares per node (default: config, 1)")
    t.add_argument("--run-dir", "--run_dir", default=None, help="workers.json, events.jsonl and logs (default: config run_dir)")
    t.add_argument("--config", default=None, help="a torchpass preset name or YAML file")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override one config field (repeatable)")
    t.add_argument("--chaos", default=None, help="a chaos scenario from configs/chaos (deterministic fault injection)")
    t.add_argument("--quiet", action="store_true", help="do not copy worker output to this console")
    t.add_argument(
        "--secret-file",
        "--secret_file",
        default=None,
        help=f"a file holding the job secret, the same on every node (else ${job_secret.SECRET_ENV}; a single-node job generates one)",
    )
    p.add_argument("training_script", help="the script (or module with -m) to run on every rank")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER)


def _parse_overrides(items: list[str]) -> dict[str, Any]:
    import yaml

    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise LaunchError(f"--set {item!r}: expected KEY=VALUE")
        key, raw = item.split("=", 1)
        value = yaml.safe_load(raw) if raw.strip() else raw  # YAML scalars: true, 3, 0.5, text
        target = out
        parts = key.strip().split(".")
        for part in parts[:-1]:
            target = target.setdefault(part, {})
        target[parts[-1]] = value
    return out


def _config(args: argparse.Namespace) -> TorchPassConfig:
    overrides = _parse_overrides(args.set)
    if args.chaos:
        overrides = deep_merge(load_scenario("chaos", args.chaos), overrides)
    if args.config:
        return load_preset(args.config, overrides)
    return config_from_mapping(overrides, source="torchpass launch --set")


def _etcd_store(url: str, rdzv_id: str, nnodes: int, run_id: str) -> str | None:
    """The job's etcd URL (``--store`` with the job's id appended), or None for node 0's TCPStore."""
    if not url:
        return None
    try:
        parse_etcd_url(url)
    except ValueError as exc:
        raise LaunchError(str(exc)) from None
    if nnodes > 1 and not rdzv_id:
        raise LaunchError(f"--store {shown_url(url)}: give every node the same --rdzv-id; the job's keys live under it")
    return job_url(url, run_id)


def _connect_etcd(url: str, node_rank: int, rdzv_id: str, join_timeout: float) -> EtcdStore:
    """Node 0: the job's keys must not exist yet (a job with this id ran, or runs); others: wait for node 0's job."""
    try:
        store = EtcdStore(parse_etcd_url(url), timedelta(seconds=join_timeout))
        if node_rank == 0:
            if store.num_keys():
                raise LaunchError(
                    f"--store: {shown_url(url)} already holds a job's keys (--rdzv-id {rdzv_id or '(generated)'}); a job that "
                    f"crashed leaves them: give a new --rdzv-id, or delete them (etcdctl del --prefix {parse_etcd_url(url).prefix}/)"
                )
        else:
            store.wait([Keys.job], timedelta(seconds=join_timeout))
    except dist.DistError as exc:
        raise LaunchError(f"cannot use the etcd store {shown_url(url)}: {exc}") from None
    return store


def _nnodes(value: str) -> int:
    lo, _, hi = value.partition(":")
    if hi and hi != lo:
        raise LaunchError(f"--nnodes {value}: torchpass keeps the world size fixed; give one number (MIN == MAX)")
    try:
        return positive_int(lo, "--nnodes")
    except ValueError as exc:
        raise LaunchError(str(exc)) from None



def _rdzv_conf(text: str) -> dict[str, str]:
    out = {}
    for part in filter(None, text.split(",")):
        key, _, value = part.partition("=")
        out[key.strip()] = value.strip()
    return out


_CAMPAIGN_INTERVAL_S = 0.5
"""How often a launcher that does not run the controller looks whether its lease is free (one etcd read)."""
MIGRATING_TICK_S = 0.005
"""The controller's tick while training waits on a migration (``Controller.training_waits``), instead of
``--monitor-interval``. Each step of those phases (every report in, every rank ready) is seen at the next tick,
so at the monitor interval (50 ms) each waited for a sleep to end: measured, 52 ms of a ZeRO-3 job's 0.65 s
recovery went to the first alone. Such a tick reads O(1) store keys (counters): on the TCPStore tens of
microseconds each; on etcd about 3 requests, 600 a second while those phases last (under a second here,
longer where a spare sets up a large model)."""


def _orders(store: Any, nnodes: int) -> Any:
    """The controller's way to post an order (fence, retire) to node ``n``'s agent."""
    mail = {n: Mailbox(store, Keys.node_mail(n)) for n in range(nnodes)}
    return lambda node, order: mail[node].post(order) if node in mail else None


def _take_over(
    lease: ControllerLease, store: Any, secret: bytes, join_timeout: float, run_dir: Path, say: _Console, nnodes: int,
    address: str, store_etcd: str | None,
) -> Controller | None:
    """This launcher's controller when the lease is free and it wins it (the last one was lost), else None."""
    if not lease.free() or not lease.campaign():
        return None
    assert store_etcd is not None
    say(f"the controller's lease was free (the launcher that ran it is gone): node {say.node} takes the controller over")
    cstore = signed(lease.guarded(), secret, timedelta(seconds=join_timeout))
    t0 = time.monotonic()
    controller = Controller.take_over(cstore, run_dir, say, _orders(cstore, nnodes), address, store_etcd, say.node)
    say(f"controller taken over at generation {controller.generation} in {time.monotonic() - t0:.2f} s")
    return controller


def tick_interval(controller: Controller | None, monitor_interval: float) -> float:
    """Seconds the launcher's loop sleeps before its next tick: ``MIGRATING_TICK_S`` while training waits on the
    controller it runs, else ``--monitor-interval``."""
    if controller is not None and controller.training_waits:
        return min(MIGRATING_TICK_S, monitor_interval)
    return monitor_interval


def _metrics_after_take_over(controller: Controller, say: _Console) -> JobMetrics | None:
    """The job's metrics follow its controller: served from this host now, on the configured port (a port taken
    here costs the metrics, said once, never the job)."""
    at = controller.config.metrics
    if not at.port:
        return None
    metrics = JobMetrics()
    try:
        metrics.serve(at.host, at.port)
    except OSError as exc:
        say(f"metrics.port: cannot serve metrics on {at.host}:{at.port} on this host ({exc}); the job goes on without them")
        return None
    controller.ledger.listeners.append(metrics.on_event)
    say(f"metrics for Prometheus now at http://{at.host}:{at.port}/metrics on node {say.node}")
    return metrics


def _prepare_run_dir(run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    old = [run_dir / n for n in ("events.jsonl", "workers.json", "logs", "summary.json", TIMELINE_FILE) if (run_dir / n).exists()]
    if old:
        archive = run_dir / "previous" / time.strftime("%Y%m%d-%H%M%S")
        archive.mkdir(parents=True)
        for path in old:
            shutil.move(str(path), str(archive / path.name))


class _Console:
    def __init__(self, node: int, enabled: bool):
        self.node = node
        self.enabled = enabled

    def __call__(self, message: str) -> None:
        if self.enabled:
            print(f"[torchpass node{self.node} {time.strftime('%H:%M:%S')}] {message}", flush=True)


def launch(args: argparse.Namespace) -> int:
    """Run one node of a job; returns the process exit code."""
    try:
        return _launch(args)
    except (LaunchError, ConfigError) as exc:
        print(f"torchpass launch: error: {exc}", file=sys.stderr, flush=True)
        return 2


def _placement_from_slurm(args: argparse.Namespace) -> None:
    """Fill the placement flags not given from the ``srun`` step this runs in, if any (see ``core/slurm.py``)."""
    given = {"--nnodes": args.nnodes, "--node-rank": args.node_rank, "--master-addr": args.master_addr}
    if all(v is not None for v in given.values()):
        return
    try:
        placement = slurm_placement()
    except (RuntimeError, OSError, ValueError, KeyError, IndexError) as exc:
        raise LaunchError(f"cannot read the placement of this srun step ({exc}); pass --nnodes, --node-rank and --master-addr") from None
    if placement is not None:
        args.nnodes = str(placement.nnodes) if args.nnodes is None else args.nnodes
        args.node_rank = placement.node_rank if args.node_rank is None else args.node_rank
        args.master_addr = placement.master_addr if args.master_addr is None else args.master_addr
        print(
            f"torchpass launch: from the srun step: --nnodes {args.nnodes} --node-rank {args.node_rank} --master-addr {args.master_addr}",
            flush=True,
        )
    args.nnodes = "1" if args.nnodes is None else args.nnodes
    args.node_rank = 0 if args.node_rank is None else args.node_rank
    args.master_addr = "127.0.0.1" if args.master_addr is None else args.master_addr


def _signal_sources(config: TorchPassConfig, slots: int) -> list[NodeSignalSource]:
    """What this node's agent watches (``signals.*``): Slurm's view of the node, NVML's of its ``slots`` GPUs."""
    sig = config.signals
    sources: list[NodeSignalSource] = []
    if sig.slurm == "required" or (sig.slurm == "auto" and "SLURM_JOB_ID" in os.environ and slurm_available()):
        if not slurm_available():
            raise LaunchError(
                "signals.slurm: got 'required', but Slurm's sinfo and scontrol are not on PATH; set it to 'auto' or 'disabled'"
            )
        sources.append(SlurmDrainSource(slurm_node_name(), sig.maint_lead_s))
    if sig.nvml != "disabled":
        nvml, why_not = probe_nvml()
        if nvml is None and sig.nvml == "required":
            raise LaunchError(f"signals.nvml: got 'required', but {why_not}; set it to 'auto' or 'disabled'")
        if nvml is None:
            print(f"torchpass launch: GPU health signals off: {why_not}", flush=True)
        else:
            thresholds = GpuThresholds(sig.ecc_uncorrected_increase, sig.thermal_margin_c, parse_xids(sig.xids))
            sources.append(GpuHealthSource(nvml, gpu_handles(nvml, slots), thresholds))
    if sig.k8s == "required" or (sig.k8s == "auto" and in_cluster() and kubernetes_available()):
        sources.append(_kubernetes_source(config))
    return sources


def _kubernetes_source(config: TorchPassConfig) -> NodeSignalSource:
    sig = config.signals
    if not kubernetes_available():
        raise LaunchError("signals.k8s: got 'required', but the kubernetes client is not installed (pip install 'torchpass[k8s]')")
    node = sig.k8s_node or os.environ.get("NODE_NAME", "")
    if not node:
        raise LaunchError(
            "signals.k8s_node: empty and NODE_NAME is not set; set NODE_NAME from the downward API (spec.nodeName) "
            "or give the node's name"
        )
    taints = frozenset(filter(None, (k.strip() for k in sig.k8s_taints.split(","))))
    pod = os.environ.get("POD_NAME") or socket.gethostname()
    try:
        return KubernetesSource(node, sig.k8s_namespace or default_namespace(), sig.k8s_pod_selector, taints, sig.k8s_kubeconfig, pod)
    except Exception as exc:  # the client's ConfigException, a missing or unreadable file: named, not started
        raise LaunchError(f"signals.k8s_kubeconfig: cannot load Kubernetes credentials ({type(exc).__name__}: {exc})") from None


def _launch(args: argparse.Namespace) -> int:
    config = _config(args)
    _placement_from_slurm(args)
    nnodes = _nnodes(args.nnodes)
    spares = config.spares_per_node if args.spares_per_node is None else args.spares_per_node
    if spares < 0:
        raise LaunchError(f"--spares-per-node: got {spares}; expected an integer >= 0")
    gpus = devices.gpu_count()
    try:
        nproc = devices.nproc_per_node(str(args.nproc_per_node), spares, gpus, os.cpu_count() or 1)
    except ValueError as exc:
        raise LaunchError(str(exc)) from None
    for note in (devices.sharing_note(nproc, spares, gpus), nccl_transport.check_environment(os.environ) if gpus else None):
        if note:
            print(f"torchpass launch: {note}", flush=True)
    if not 0 <= args.node_rank < nnodes:
        raise LaunchError(f"--node-rank: got {args.node_rank}; expected 0..{nnodes - 1} for --nnodes {nnodes}")
    if args.no_python:
        raise LaunchError("--no-python is not supported: torchpass runs every worker through its Python bootstrap")
    sources = _signal_sources(config, nproc + spares)
    if args.max_restarts:
        print("torchpass launch: --max-restarts ignored: failed ranks migrate to hot spares instead of restarting", flush=True)
    script_args = list(args.training_script_args)
    if args.module:
        if importlib.util.find_spec(args.training_script) is None:
            raise LaunchError(f"module {args.training_script!r} not found (given with -m)")
        target = ["-m", args.training_script, *script_args]
    else:
        if not Path(args.training_script).is_file():
            raise LaunchError(f"training script {args.training_script!r} not found")
        target = [str(Path(args.training_script).resolve()), *script_args]
    if args.standalone:
        host, port = "127.0.0.1", free_port()
    elif args.rdzv_endpoint:
        host, _, port_s = args.rdzv_endpoint.rpartition(":")
        if not host or not port_s.isdigit():
            raise LaunchError(f"--rdzv-endpoint {args.rdzv_endpoint!r}: expected HOST:PORT")
        port = int(port_s)
    else:
        host, port = args.master_addr, args.master_port
    try:
        secret, secret_from = job_secret.for_launch(args.secret_file, nnodes)
    except job_secret.SecretError as exc:
        raise LaunchError(str(exc)) from None
    join_timeout = float(_rdzv_conf(args.rdzv_conf).get("join_timeout", 600))
    run_id = args.rdzv_id or uuid.uuid4().hex[:8]
    store_etcd = _etcd_store(args.store, args.rdzv_id, nnodes, run_id)
    run_dir = Path(args.run_dir or config.run_dir).resolve()
    say = _Console(args.node_rank, config.telemetry.console)

    tcp_server = None
    if args.node_rank == 0:
        try:
            # With an etcd store it serves the workers' set-up only: init_process_group's default store.
            tcp_server = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=join_timeout))
        except (RuntimeError, OSError) as exc:
            raise LaunchError(f"cannot host the torchpass store on {host}:{port}: {exc} (is the port in use? pass --master-port)") from None
    store_shown = shown_url(store_etcd) if store_etcd is not None else f"{host}:{port}"
    if store_etcd is not None:
        base = _connect_etcd(store_etcd, args.node_rank, args.rdzv_id, join_timeout)
    elif tcp_server is not None:
        base = tcp_server
    else:
        try:
            base = dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=join_timeout))
            base.wait([Keys.job], timedelta(seconds=join_timeout))
        except (RuntimeError, OSError) as exc:
            raise LaunchError(f"cannot reach the torchpass store of node 0 at {host}:{port} within {join_timeout:.0f} s: {exc}") from None
    store = signed(base, secret, timedelta(seconds=join_timeout))
    lease = None
    if isinstance(base, EtcdStore):
        lease = ControllerLease(base, args.node_rank, config.controller_lease_s)
        if args.node_rank == 0 and not lease.campaign():
            raise LaunchError(f"--store: another launcher holds the controller of job {run_id!r} on {store_shown}; give a new --rdzv-id")
    if args.node_rank != 0 and not store.check([Keys.job]):
        raise LaunchError(
            f"node 0's store at {host}:{port} holds a job not sealed with this node's secret ({secret_from}): "
            "give every node the same --secret-file or TORCHPASS_SECRET"
        )

    metrics = None
    if args.node_rank == 0 and config.metrics.port:
        metrics = JobMetrics()
        try:
            metrics.serve(config.metrics.host, config.metrics.port)
        except OSError as exc:
            raise LaunchError(
                f"metrics.port: cannot serve metrics on {config.metrics.host}:{config.metrics.port}: {exc}; choose a free port, or 0 for none"
            ) from None
    if args.node_rank == 0:
        _prepare_run_dir(run_dir)
    if secret_from == job_secret.GENERATED:
        # For this user's `torchpass status` / `migrate` on the run dir; gone with the launcher.
        atexit.register(job_secret.keep_generated(run_dir, secret).unlink, missing_ok=True)
    else:
        # The run dir may be node 0's own (a shared file system, or every node on one machine): another
        # node archiving what is there would move the live ledger and workers.json from under the controller.
        run_dir.mkdir(parents=True, exist_ok=True)
    spec = NodeSpec(args.node_rank, nnodes, nproc, spares, host, port, run_id, run_dir, target, tee=not args.quiet, store_etcd=store_etcd)
    controller = None
    if args.node_rank == 0:
        job = JobSpec(nnodes * nproc, nnodes, nproc, spares, run_id, [sys.executable, *target])
        cstore = store if lease is None else signed(lease.guarded(), secret, timedelta(seconds=join_timeout))
        controller = Controller(cstore, job, run_dir, config, say, _orders(cstore, nnodes), f"{host}:{port}", store_etcd)
    if controller is not None and metrics is not None:
        controller.ledger.listeners.append(metrics.on_event)
        say(f"metrics for Prometheus at http://{config.metrics.host}:{config.metrics.port}/metrics")
    agent = Agent(spec, store, config, say, secret)
    watcher = NodeSignalWatcher(sources, config.signals.poll_interval_s, say)
    stop = {"signals": 0}

    def on_signal(signum: int, frame: Any) -> None:
        del frame
        stop["signals"] += 1
        stop["last"] = signum

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    say(f"starting {nproc} worker(s) and {spares} spare(s) on node {args.node_rank} of {nnodes}; run dir {run_dir}; job secret: {secret_from}")
    agent.start()
    watcher.start()
    events = Mailbox(store, Keys.events)
    draining = False
    last_config_check = 0.0
    last_sample = 0.0
    last_campaign = time.time()
    last_end_check = 0.0
    timeline = Timeline(run_dir)
    while True:
        if controller is not None and lease is not None and not lease.held:
            say(f"this launcher no longer runs the controller: {lease.lost_because}")
            controller = None
        if controller is not None:
            try:
                agent.tick()
                controller.tick()
            except GuardLost as exc:
                say(f"this launcher no longer runs the controller: another holds its lease ({exc})")
                controller = None
                continue
            except dist.DistError as exc:
                # Only an etcd store fails this way (node 0's TCPStore is in this process): no member answered.
                agent.abandon(f"lost the store at {store_shown}: {exc}", STORE_LOST_EXIT)
            if time.time() - last_sample >= SAMPLE_S:
                last_sample = time.time()
                sample = take_sample(controller)
                timeline.record(sample)
                if metrics is not None:
                    metrics.refresh(controller, sample)
            if controller.outcome is not None:
                break
        else:
            try:
                agent.tick()
                # The job's end, at the agent's beat pace (a read per tick per node would load the store for nothing).
                if time.time() - last_end_check >= agent.config.heartbeat_interval_s / 2:
                    last_end_check = time.time()
                    if store.check([Keys.shutdown]):
                        break
                if lease is not None and time.time() - last_campaign >= _CAMPAIGN_INTERVAL_S:
                    last_campaign = time.time()
                    controller = _take_over(lease, store, secret, join_timeout, run_dir, say, nnodes, f"{host}:{port}", store_etcd)
                    if controller is not None and metrics is None:
                        metrics = _metrics_after_take_over(controller, say)
            except dist.DistError as exc:
                # Node 0's store went away (a stopped or unreachable one is the agent's watchdog's case).
                agent.abandon(f"lost the store at {store_shown}: {exc}", STORE_LOST_EXIT)
        for source, found in watcher.take():
            detail = {"signal": found.cause, "cause": found.cause, "reason": found.reason, "trigger": found.detail}
            if found.gpu is not None:
                wid = agent.worker_in_slot(found.gpu)
                if wid is not None and not draining:
                    say(f"{source}: {found.reason}: moving the process on it ({wid}) to a spare")
                    events.post(Report("drain", wid, args.node_rank, detail=detail))
            elif not draining:
                draining = True
                say(f"{source}: {found.reason}: draining this node's ranks to spares elsewhere")
                events.post(Report("node_drain", node=args.node_rank, detail=detail))
        if stop["signals"] == 1 and stop.get("last") == signal.SIGTERM and not draining:
            draining = True
            say("SIGTERM: draining this node's ranks to spares elsewhere (a second signal stops the job)")
            events.post(Report("node_drain", node=args.node_rank, detail={"signal": "SIGTERM"}))
        elif stop["signals"] >= 1 and (stop.get("last") == signal.SIGINT or stop["signals"] > 1):
            if controller is not None:
                controller.stop_on_request("stopped by a signal to node 0's launcher")
                break
            agent.stop_all()
            return 143
        if draining and controller is None and not agent.alive():
            say("node drained")
            return 0
        if time.time() - last_config_check > 2.0:
            agent.refresh_config()
            last_config_check = time.time()
        time.sleep(tick_interval(controller, args.monitor_interval))

    if controller is not None:
        assert controller.outcome is not None
        code, message = controller.outcome
        timeline.record(take_sample(controller), keep=True)
    else:
        outcome = json.loads(store.get(Keys.outcome)) if store.check([Keys.outcome]) else {"code": 1, "message": "node 0 went away"}
        code, message = int(outcome["code"]), str(outcome["message"])
    watcher.stop()
    deadline = time.time() + 30
    while agent.alive() and time.time() < deadline:
        agent.tick()
        time.sleep(0.05)
    agent.stop_all()
    if controller is not None:
        (run_dir / "summary.json").write_text(json.dumps({"exit_code": code, "message": message}, indent=1))
        # Other launchers read the shutdown key; give them a moment before the store goes away.
        time.sleep(1.0)
        if isinstance(base, EtcdStore):
            # The job's keys go with it: the same --rdzv-id can run again (a crashed job's stay, and block that).
            base.delete_prefix()
    if lease is not None:
        lease.resign()
    if code == 0:
        say(f"job finished: {message}")
    else:
        print(f"torchpass: job failed: {message}", file=sys.stderr, flush=True)
    return code

