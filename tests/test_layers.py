"""The import layers of docs/architecture.md hold: import-linter's contracts in
pyproject.toml (who may import whom, no cycles within a package)."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_import_contracts_are_kept():
    linter = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    done = subprocess.run([linter, "--no-cache"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout
