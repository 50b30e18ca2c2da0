"""zsim: plan large-model training before the cluster is rented.

A discrete-event simulator of one DeepSpeed ZeRO / 3D-parallel training step on a GPU cluster,
with a memory ledger, a calibration runner and a validation loop. The names a caller needs are
here; the packages are the layers (workload, cluster, network, step, memory, inputs, outputs).

    >>> import zsim
    >>> layout = zsim.ParallelConfig(dp=8, zero_stage=3, micro_batch=4)
    >>> report = zsim.simulate(zsim.model_preset("gpt-1.3b"), layout,
    ...                        zsim.presets.topology("2x4-ethernet"), zsim.presets.gpu("a100-80gb"))
    >>> report.step_time_s > 0
    True
"""

from zsim.cluster.device import DeviceProfile
from zsim.cluster.topology import Topology
from zsim.errors import InputError
from zsim.inputs import presets
from zsim.memory import MemoryLedger, ledger
from zsim.simulation import Report, simulate
from zsim.workload.ds_config import from_ds_config, to_ds_config
from zsim.workload.model import ModelSpec
from zsim.workload.model_presets import from_params
from zsim.workload.model_presets import preset as model_preset
from zsim.workload.parallel import (
    Offload,
    ParallelConfig,
    PipelineEngine,
    PipelineSchedule,
    Precision,
    Recompute,
    ZeroKnobs,
    ZeroStage,
)

__version__ = "0.1.0"
__all__ = [
    "DeviceProfile",
    "InputError",
    "MemoryLedger",
    "ModelSpec",
    "Offload",
    "ParallelConfig",
    "PipelineEngine",
    "PipelineSchedule",
    "Precision",
    "Recompute",
    "Report",
    "Topology",
    "ZeroKnobs",
    "ZeroStage",
    "from_ds_config",
    "from_params",
    "ledger",
    "model_preset",
    "presets",
    "simulate",
    "to_ds_config",
]
