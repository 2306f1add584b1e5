"""The ``torchpass`` command: ``launch``, ``status``, ``report``, ``inject``, ``migrate``, ``chaos`` and ``demo``."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="torchpass", description="Live migration of PyTorch training ranks to hot spares.")
    sub = p.add_subparsers(dest="command", required=True)
    from .launcher import add_launch_arguments

    add_launch_arguments(sub.add_parser("launch", help="start a job like torchrun, plus hot spares"))
    secret_help = "the job's secret file (else $TORCHPASS_SECRET, or the secret your single-node launch generated)"
    st = sub.add_parser("status", help="show the workers of a job")
    st.add_argument("--run-dir", required=True)
    st.add_argument("--secret-file", default=None, help=secret_help)
    st.add_argument("--watch", action="store_true", help="redraw the view until the job ends (ranks, spares, steps, a migration's phase)")
    st.add_argument("--interval", type=float, default=1.0, help="--watch: seconds between redraws (default 1)")
    rp = sub.add_parser("report", help="success rate and time lost, from a job's ledger")
    rp.add_argument("--run-dir", required=True)
    rp.add_argument("--json", action="store_true", help="machine-readable output")
    rp.add_argument("--plot", metavar="FILE.png", help="also draw the job's timeline (steps, each migration's phases, spares) to FILE.png")
    inj = sub.add_parser("inject", help="inject a real fault into a running job")
    inj.add_argument("--run-dir", required=True)
    who = inj.add_mutually_exclusive_group(required=True)
    who.add_argument("--rank", type=int, help="the active worker holding this rank")
    who.add_argument("--worker", help="a worker id from `torchpass status` (e.g. a spare)")
    inj.add_argument("--fault", required=True, choices=("kill", "hang", "term", "node"))
    mig = sub.add_parser("migrate", help="ask for a planned migration of a rank (it hands its state to a spare and leaves)")
    mig.add_argument("--run-dir", required=True)
    mig.add_argument("--rank", type=int, required=True)
    mig.add_argument("--secret-file", default=None, help=secret_help)
    chaos = sub.add_parser(
        "chaos",
        help="a campaign of real faults against your job, each run compared bit for bit with a fault-free run",
        description="Runs the job once without faults, then once per fault, and prints a table. Everything after "
        "'--' is what you would pass to `torchpass launch` (minus --nnodes/--node-rank/--master-*/--run-dir).",
    )
    chaos.add_argument("--campaign", default="quick", help="configs/chaos/campaign/NAME.yaml, or a YAML path (default: quick)")
    chaos.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a campaign field (repeatable)")
    chaos.add_argument("launch_args", nargs=argparse.REMAINDER, help="-- then the launch arguments and the script")
    demo = sub.add_parser("demo", help="a live migration end to end, checked bitwise against a fault-free run")
    demo.add_argument("--run-dir", default="torchpass_demo")
    demo.add_argument("--fault", default="kill", choices=("kill", "hang", "term"))
    return p


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.command == "launch":
        from .launcher import launch

        sys.exit(launch(args))
    if args.command == "status":
        from .job_secret import SecretError
        from .status import format_status, watch_status

        if args.interval <= 0:
            raise SystemExit(f"torchpass status: --interval: got {args.interval:g}; expected a number of seconds > 0")
        try:
            if args.watch:
                watch_status(args.run_dir, args.secret_file, args.interval, sys.stdout, clear=sys.stdout.isatty())
            else:
                print(format_status(args.run_dir, args.secret_file))
        except (SecretError, FileNotFoundError) as exc:
            raise SystemExit(f"torchpass status: {exc}") from None
        except KeyboardInterrupt:
            return  # the operator stopped watching
    elif args.command == "report":
        from .report import build_report, format_report, report_json

        rep = build_report(args.run_dir)
        print(report_json(rep) if args.json else format_report(rep))
        if args.plot:
            if not args.plot.lower().endswith(".png"):
                raise SystemExit(f"torchpass report: --plot {args.plot!r}: expected a .png file name")
            from .report_plot import plot_run

            try:
                path = plot_run(args.run_dir, args.plot)
            except ImportError as exc:
                raise SystemExit(f"torchpass report: --plot needs matplotlib ({exc}): pip install 'torchpass[plot]'") from None
            print(f"timeline drawn to {path}", file=sys.stderr)
    elif args.command == "inject":
        from .inject import inject

        try:
            pids = inject(args.run_dir, args.fault, rank=args.rank, wid=args.worker)
        except (LookupError, FileNotFoundError) as exc:
            raise SystemExit(f"torchpass inject: {exc}") from None
        print(f"sent {args.fault} to pid(s) {', '.join(map(str, pids))}")
    elif args.command == "migrate":
        from .inject import request_migration
        from .job_secret import SecretError

        try:
            request_migration(args.run_dir, args.rank, args.secret_file)
        except (SecretError, LookupError, FileNotFoundError) as exc:
            raise SystemExit(f"torchpass migrate: {exc}") from None
        print(f"asked the controller to migrate rank {args.rank}")
    elif args.command == "chaos":
        sys.exit(_chaos(args))
    elif args.command == "demo":
        from .demo import run_demo

        sys.exit(run_demo(args.run_dir, args.fault))


def _chaos(args: argparse.Namespace) -> int:
    from .campaign import DISQUALIFIED, RESOLVED, VOID, format_summary, load_campaign, run_campaign

    launch_args = args.launch_args[1:] if args.launch_args[:1] == ["--"] else args.launch_args
    if not launch_args:
        raise SystemExit("torchpass chaos: give the job after '--', e.g. -- --nproc-per-node 4 --spares-per-node 2 train.py")
    try:
        config = load_campaign(args.campaign, args.set)
    except ValueError as exc:
        raise SystemExit(f"torchpass chaos: {exc}") from None
    try:
        runs = run_campaign(config, launch_args, say=lambda line: print(line, flush=True))
    except RuntimeError as exc:
        raise SystemExit(f"torchpass chaos: {exc}") from None
    print(format_summary(runs))
    # Disqualified runs are clean refusals with a reason; hangs and wrong states fail the campaign.
    # A void run (its fault never landed, the job finished clean) fails nothing, but a campaign needs a landed fault.
    return 0 if all(r.verdict in (RESOLVED, DISQUALIFIED, VOID) for r in runs) and any(r.verdict != VOID for r in runs) else 1


if __name__ == "__main__":
    main()
