"""zsim: plan large-model training before the cluster is rented.

A discrete-event simulator of one DeepSpeed ZeRO / 3D-parallel training step on a GPU cluster,
with a memory ledger, a calibration runner and a validation loop.
"""

__version__ = "0.1.0"
