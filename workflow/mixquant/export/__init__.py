"""mixquant.export: the structure of a ModelOpt-format mixed-precision checkpoint, predicted and audited.

:mod:`~mixquant.export.predict` derives tensor counts, payload bytes and effective routed-expert bits from
config.json and a placement alone; :mod:`~mixquant.export.inspect` audits an exported checkpoint directory
from its safetensors headers, index and JSON files, so the two can be compared number for number.
"""
