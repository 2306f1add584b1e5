"""A ``torchpass chaos`` campaign over TorchTitan's shipped llama3 debug config, HSDP 2 x 2, bf16 as shipped.

    python -m tests.support.torchtitan.campaign --faults 20 --seed 104 --nodes 2 --out /tmp/titan-campaign

TorchTitan's training data and tokenizer are not in its wheel, so the job needs
the test suite's assets and CPU shim: this builds them, then hands the job to
:func:`torchpass.core.campaign.run_campaign` exactly as ``torchpass chaos``
would (the figures are in docs/reliability.md).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from torchpass.core.campaign import format_summary, load_campaign, run_campaign

from .assets import make_assets
from .jobs import ENTRY_POINT, job_env, shipped_args


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--faults", type=int, default=20)
    p.add_argument("--seed", type=int, default=104)
    p.add_argument("--nodes", type=int, default=2, help="simulated nodes (2: the 'node' kind is drawn too)")
    p.add_argument("--out", type=Path, default=Path("titan-campaign"))
    args = p.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    assets = make_assets(out / "assets")
    os.environ.update(job_env(out / "hf-cache"))
    per_node = 4 // args.nodes
    campaign = "full" if args.nodes > 1 else "quick"
    overrides = [f"faults={args.faults}", f"seed={args.seed}", f"nodes={args.nodes}", f"run_dir={out / 'runs'}", "job_timeout_s=900"]
    config = load_campaign(campaign, overrides)
    launch_args = [
        "--nproc-per-node", str(per_node), "--spares-per-node", "2", "--config", "fast_detect",
        "-m", ENTRY_POINT, *shipped_args("debug_model", "hsdp", assets),
    ]  # fmt: skip
    runs = run_campaign(config, launch_args, say=lambda line: print(line, flush=True))
    print(format_summary(runs))


if __name__ == "__main__":
    main()
