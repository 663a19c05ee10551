"""The four source folders are installed as ``speccal.*``; nothing may import them bare."""

from __future__ import annotations

import subprocess
import sys

BARE = ("runner", "kernels", "calibrate", "costmodel")


def test_no_bare_top_level_module_is_imported():
    code = (
        "import sys, speccal.cli, speccal.costmodel, speccal.runner, speccal.kernels, "
        "speccal.calibrate\n"
        f"bad = [m for m in sys.modules if m.split('.')[0] in {BARE!r}]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"bare top-level modules imported: {out.stdout.strip()}"


def test_torch_free_core_does_not_import_torch():
    code = (
        "import sys, speccal.costmodel, speccal.base.errors\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_version_flag():
    out = subprocess.run(
        [sys.executable, "-m", "speccal", "--version"], capture_output=True, text=True, check=True
    )
    assert out.stdout.startswith("speccal ")
