"""zsim: plan large-model training before the cluster is rented.

A discrete-event simulator of one DeepSpeed ZeRO / 3D-parallel training step on a GPU cluster,
with a memory ledger, a calibration runner and a validation loop.

    >>> from zsim import presets, simulate
    >>> from zsim.model import preset
    >>> from zsim.parallel import ParallelConfig
    >>> topo = presets.topology("2x4-ethernet")
    >>> report = simulate(preset("gpt-1.3b"), ParallelConfig(dp=8, zero_stage=3, micro_batch=4),
    ...                   topo, presets.gpu("a100-80gb"))
    >>> report.step_time_s > 0
    True
"""

from zsim.simulation import Report, simulate

__version__ = "0.1.0"
__all__ = ["Report", "simulate"]
