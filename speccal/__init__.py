"""speccal: calibration and cost modelling for speculative decoding with MTP draft heads.

The top-level package stays import-light (no torch, no CLI): ``speccal.costmodel``,
``speccal.policy``, ``speccal.policy_rules`` and ``speccal.replay`` must run in a notebook
without a GPU stack.
"""

import time
from importlib.metadata import PackageNotFoundError, version

#: ``time.perf_counter()`` when the package was first imported: the start of a ``speccal``
#: command's own imports (``speccal.calibrate.machine.process_age_s`` measures from here; the
#: process's start time in ``/proc`` can be a shell's that exec'd the command).
IMPORTED_AT = time.perf_counter()

try:
    __version__ = version("speccal")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
