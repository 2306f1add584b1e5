"""The worker bootstrap's spare preload: which modules a spare imports while it waits, and that what they
made is kept out of later garbage collections."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from torchpass.core.worker import _script_imports


def test_a_spare_preloads_every_installed_module_the_script_imports(tmp_path: Path) -> None:
    (tmp_path / "helpers.py").write_text("")
    script = tmp_path / "train.py"
    script.write_text(
        "import json, torch.nn\n"
        "from helpers import thing\n"
        "from . import sibling\n"
        "def main():\n"
        "    import torch.distributed.checkpoint as dcp\n"
        "    from numpy.linalg import norm\n"
        "    import not_installed_anywhere\n"
        "    if True:\n"
        "        from torch.utils.data import DataLoader\n"
    )
    names = _script_imports(str(script))
    # Full module paths, imports inside functions included, files next to the script and absent packages left out.
    assert names == ["json", "torch.nn", "torch.distributed.checkpoint", "numpy.linalg", "torch.utils.data"]


def test_an_unreadable_script_preloads_nothing(tmp_path: Path, capsys) -> None:
    assert _script_imports(str(tmp_path / "missing.py")) == []
    assert "not preloading imports" in capsys.readouterr().err


FREEZE_PROBE = """
import gc, json, weakref
from torchpass.core.worker import _freeze_preloaded

class Node:
    pass

def cycle():
    a, b = Node(), Node()
    a.peer, b.peer = b, a
    return weakref.ref(a)

kept = Node()
garbage_before = cycle()
_freeze_preloaded()
frozen = gc.get_freeze_count()
garbage_after = cycle()
gc.collect()
print(json.dumps({
    "garbage_before_collected": garbage_before() is None,
    # gc.get_objects() lists the objects collections walk: a tracked object left out of it is frozen.
    "kept_frozen": gc.is_tracked(kept) and not any(o is kept for o in gc.get_objects()),
    "frozen": frozen,
    "garbage_after_collected": garbage_after() is None,
}))
"""


def test_a_spare_collects_the_preload_s_garbage_then_freezes_what_is_left() -> None:
    """A spare's later collections (frameworks collect during set-up, after the assignment) walk only what the
    script made; a cycle that becomes garbage after the freeze is still collected."""
    out = subprocess.run([sys.executable, "-c", FREEZE_PROBE], capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["garbage_before_collected"] and result["garbage_after_collected"]
    assert result["frozen"] > 1000 and result["kept_frozen"]
