#!/usr/bin/env bash
# The llama3 debug model, HSDP 2 x 2 plus one hot spare, on CPU with gloo, in one command:
#
#     examples/torchtitan/run_cpu.sh [TorchTitan overrides, e.g. --training.steps 40]
#
# To watch a migration, kill a rank while it trains (from another terminal):
#     torchpass inject --run-dir "$WORK/run" --rank 1 --fault kill
# or let torchpass do it at a precise point, through the [torchpass] section:
#     examples/torchtitan/run_cpu.sh --torchpass.chaos.kill_rank 1 --torchpass.chaos.kill_step 8
#
# torchpass runs on gloo in this release and TorchTitan assumes an accelerator, so on a CPU-only
# machine this borrows the test-support CPU shim (tests/support/torchtitan/, not product code)
# and generates the tiny tokenizer and dataset TorchTitan's wheel does not ship.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
python=${PYTHON:-python}
export WORK=${WORK:-$(mktemp -d -t torchtitan-example-XXXXXX)}
"$python" "$repo/tests/support/torchtitan/assets.py" "$WORK/assets" > /dev/null
export PYTHONPATH="$repo/tests/support/torchtitan${PYTHONPATH:+:$PYTHONPATH}"
export TORCHPASS_TEST_TORCHTITAN_CPU=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_DATASETS_CACHE="$WORK/hf_cache"
cd "$WORK"
echo "working directory: $WORK"
exec "$python" -m torchpass.core.cli launch --nproc-per-node 4 --spares-per-node 1 --run-dir "$WORK/run" \
    -m torchpass.adapters.torchtitan.train --job.config_file "$here/llama3_debug.toml" "$@"
