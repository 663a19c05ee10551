"""speccal.costmodel: measurement rows -> fitted cost models -> versioned cost tables. No torch.

Modules (one job each): ``measurements`` (row schema, IO, window combining), ``grid`` (context
overlap, additive connectivity), ``estimator`` (shared X/y handling), ``sps`` and ``additive``
(sklearn estimators), ``diagnostics`` (residuals, held-out errors), ``compat`` (compatibility
metadata, kernel digests and checks), ``lookup`` (every answer a table gives at a cell, with
the one memo), ``table_schema`` (the versioned table document), ``table_build`` (build and
refit a table from measurements), ``table`` (save, load, migrate, JSON Schema), ``synthetic``
(measurements from a known truth).
"""

from speccal.costmodel.additive import AdditiveCostModel
from speccal.costmodel.compat import Compatibility, CompatibilityWarning, SpeccalWarning
from speccal.costmodel.lookup import CostLookup, TableLookup
from speccal.costmodel.sps import SPSCostModel
from speccal.costmodel.table import load_table, save_table
from speccal.costmodel.table_build import NonPositiveCostWarning, build_table
from speccal.costmodel.table_schema import CalibrationConfig, CostTable, Provenance

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
    "TableLookup",
    "build_table",
    "load_table",
    "save_table",
]
