"""``python -m torchpass ...`` is the ``torchpass`` command (works without the console script on PATH)."""

from torchpass.core.cli import main

main()
