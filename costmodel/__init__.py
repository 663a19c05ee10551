"""speccal.costmodel: measurement rows -> fitted cost models -> versioned cost tables. No torch.

Modules (one job each): ``measurements`` (row schema, IO, window combining), ``grid`` (context
overlap, additive connectivity), ``estimator`` (shared X/y handling), ``sps`` and ``additive``
(sklearn estimators), ``diagnostics`` (residuals, held-out errors), ``compat`` (compatibility
metadata and checks), ``table`` (the versioned table: build, save, load, lookup), ``synthetic``
(measurements from a known truth).
"""

from speccal.costmodel.additive import AdditiveCostModel
from speccal.costmodel.compat import Compatibility, CompatibilityWarning, SpeccalWarning
from speccal.costmodel.sps import SPSCostModel
from speccal.costmodel.table import (
    CalibrationConfig,
    CostLookup,
    CostTable,
    NonPositiveCostWarning,
    Provenance,
    build_table,
    load_table,
    save_table,
)

__all__ = [
    "AdditiveCostModel",
    "CalibrationConfig",
    "Compatibility",
    "CompatibilityWarning",
    "CostLookup",
    "CostTable",
    "NonPositiveCostWarning",
    "Provenance",
    "SPSCostModel",
    "SpeccalWarning",
    "build_table",
    "load_table",
    "save_table",
]
