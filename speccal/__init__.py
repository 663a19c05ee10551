"""speccal: calibration and cost modelling for speculative decoding with MTP draft heads.

The top-level package stays import-light (no torch, no CLI): ``speccal.costmodel``,
``speccal.policy``, ``speccal.policy_rules`` and ``speccal.replay`` must run in a notebook
without a GPU stack.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("speccal")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
