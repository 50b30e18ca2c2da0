"""How a published training run becomes a zsim scenario: the reference rows read, each mapped
to a model shape, a parallel layout, a ZeRO stage, recompute, precision and a cluster, and its
measured step time (`reference_measured`). Used by bench_reference_runs.py."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from reference_engines import (
    engine_fields,
    kernels,
    tp_overlap_sms,
    triton_kernel,
    zero_plus_plus,
)
from reference_measured import Skip, integer, measured, text

from zsim.cluster.device import DeviceProfile
from zsim.errors import InputError
from zsim.inputs import presets
from zsim.workload.context_parallel import check_model
from zsim.workload.layout import check_split, stage_blocks
from zsim.workload.model import ModelSpec
from zsim.workload.model_presets import preset, with_overrides
from zsim.workload.parallel import (
    ParallelConfig,
    PipelineSchedule,
    Precision,
    Recompute,
    ZeroStage,
)

HERE = Path(__file__).resolve().parent
REFERENCE = HERE / "reference"
RESULTS = HERE / "results"
CSV_OUT = RESULTS / "reference_runs.csv"
MD_OUT = RESULTS / "reference_runs.md"

FILES = {
    "megatron": "runs_megatron_3d_parallel.csv",
    "bloom": "runs_bloom_3d_zero1.csv",
    "fsdp": "runs_fsdp.csv",
    "zero": "runs_zero_deepspeed.csv",
}


@dataclass(frozen=True)
class Case:
    row_id: str
    file: str
    source_id: str
    model: ModelSpec
    parallel: ParallelConfig
    fabric: str  # a preset fabric name or a YAML file under benchmarks/reference/
    nodes: int
    gpus_per_node: int
    gpu: str
    measured_s: float
    measured_from: str
    assumed: tuple[str, ...] = field(default=())  # training settings the source leaves out
    notes: tuple[str, ...] = field(default=())  # how the model and cluster were approximated

    def scenario(self) -> str:
        m, c = self.model, self.parallel
        shape = f"l{m.layers} h{m.hidden} a{m.heads}"
        shape += f" kv{m.kv_heads}" if m.kv_heads else ""
        shape += f" f{m.ffn_hidden} s{m.seq_len} V{m.vocab}"
        layout = f"tp{c.tp} pp{c.pp}" + (f" v{c.virtual_stages}" if c.virtual_stages > 1 else "")
        layout += f" dp{c.dp} mb{c.micro_batch} ga{c.grad_accum} z{int(c.zero_stage)}"
        flags = [str(c.recompute), str(c.precision)]
        flags += ["sp"] if c.sequence_parallel else []
        flags += ["flash"] if c.flash_attention else []
        cluster = f"{self.nodes}x{self.gpus_per_node}-{Path(self.fabric).stem} {self.gpu}"
        return f"{shape}; {layout} {' '.join(flags)}; {cluster}"


# ---- reading a row --------------------------------------------------------------------------

# ---- mapping --------------------------------------------------------------------------------


def framework(row: dict[str, str]) -> str:
    """The software family a row ran on; it sets the defaults for what the row leaves out."""
    fw, source = text(row, "system_framework"), text(row, "source_id")
    if "nemo" in fw or "megatron-core" in fw:
        return "mcore"
    if source.startswith("megatron_readme"):
        return "megatron"
    if source.startswith("bigscience"):
        return "bloom"
    if source.startswith("mosaicml"):
        return "mpt"
    if source.startswith("torchtitan"):
        return "torchtitan"
    if source.startswith("deepspeed"):
        return "deepspeed"
    return source


def model_of(row: dict[str, str], fw: str, assumed: list[str], notes: list[str]) -> ModelSpec:
    layers, hidden, heads = (integer(row, k) for k in ("num_layers", "hidden_size", "num_heads"))
    if not (layers and hidden and heads):
        raise Skip("model shape (layers/hidden/heads) not given")
    seq = integer(row, "seq_len")
    default = re.search(r"default (\d+)", row["seq_len"])
    if seq is None and default:  # "not stated (example default 1024)"
        seq = int(default.group(1))
        assumed.append(f"seq {seq} (the example's default)")
    elif "inferred" in text(row, "seq_len") or "default" in text(row, "seq_len"):
        assumed.append(f"seq {seq} (source: {row['seq_len']})")
    if seq is None:
        raise Skip("sequence length not given")
    vocab = integer(row, "vocab_size")
    if vocab is None and fw == "bloom":
        vocab = 250880  # BLOOM's padded vocabulary (the row's "~250k")
        notes.append("vocab 250880")
    if vocab is None and fw == "deepspeed":
        vocab = 50304  # Megatron's GPT-2 vocabulary 50257 padded to a multiple of 128
        notes.append("vocab 50304")
    if vocab is None:
        raise Skip("vocabulary not given")
    llama = "llama" in text(row, "model_name")
    base = preset("llama-70b" if llama else "gpt-175b")
    kv = integer(row, "num_kv_heads")
    ffn = integer(row, "ffn_hidden") or (None if llama else 4 * hidden)
    if ffn is None:
        raise Skip("ffn hidden size not given")
    model = with_overrides(
        base,
        layers=layers,
        hidden=hidden,
        heads=heads,
        ffn_hidden=ffn,
        seq_len=seq,
        vocab=vocab,
        kv_heads=0 if kv is None or kv == heads else kv,
    )
    if fw == "bloom":  # ALiBi positions, no dropout (tr11 configs)
        model = replace(model, learned_positions=False, dropout=False)
    if fw == "mpt":  # llm-foundry MPT: no_bias, dropout 0
        model = replace(model, bias=False, dropout=False)
    return replace(model, name=row["model_name"])


def zero_stage(row: dict[str, str], fw: str, assumed: list[str]) -> ZeroStage:
    z = text(row, "zero_stage_or_sharding")
    if "full_shard" in z or "fully_shard" in z or "zero-3" in z:
        return ZeroStage.PARAMETERS
    if "shard_grad_op" in z or "zero-2" in z:
        return ZeroStage.GRADIENTS
    if "zero-1" in z:
        return ZeroStage.OPTIMIZER
    if "zero-0" in z or "ddp" in z:
        return ZeroStage.NONE
    if fw == "mcore":
        assumed.append("distributed optimizer (ZeRO-1), overlapped grad reduce")
        return ZeroStage.OPTIMIZER
    if fw == "megatron":
        return ZeroStage.NONE  # Megatron-LM 2020-21: plain data-parallel all-reduce
    raise Skip(f"ZeRO stage / sharding not given ({row['zero_stage_or_sharding']!r})")


def recompute(row: dict[str, str], fw: str, assumed: list[str]) -> Recompute:
    r = text(row, "activation_recompute")
    if r.startswith("selective layer"):  # its layer AC; the period is not in the tables
        assumed.append("every 2nd block checkpointed (torchtitan's selective_ac_option default)")
        return Recompute.SELECTIVE_LAYER
    if r.startswith(("full", "yes")):
        return Recompute.FULL
    if fw == "torchtitan" and r.startswith("selective"):  # its op-level AC (every 2nd mm)
        if r != "selective op":  # train_configs/llama3_8b.toml: selective_ac_option = 'op'
            assumed.append("selective AC 'op' (torchtitan's default)")
        return Recompute.SELECTIVE_OP
    if r.startswith("selective"):
        return Recompute.SELECTIVE
    if r.startswith("none"):
        return Recompute.NONE
    default = {
        "megatron": Recompute.FULL,  # --checkpoint-activations in the 2020-21 scripts
        "deepspeed": Recompute.FULL,  # the Megatron GPT-2 examples checkpoint activations
        "mcore": Recompute.NONE,  # Megatron-Core / NeMo default
    }
    if fw not in default:
        raise Skip(f"activation recompute not given ({row['activation_recompute']!r})")
    assumed.append(f"recompute {default[fw]}")
    return default[fw]


# What a source says of the precision its rows leave unstated: BigScience's prequel chronicles
# ("Rebalancing layers", 2022-02-27): "from now on the testing is happening with BF16
# optimizer ... this is compared to fp16 which grad accumulates in fp16": the tests before it
# ran fp16 (train/tr11-176B-ml/chronicles-prequel.md).
UNSTATED_PRECISION = {"bigscience_tr11_prequel": Precision.FP16}


def precision(row: dict[str, str], fw: str, assumed: list[str]) -> Precision:
    p = text(row, "precision")
    if ("fp8" in p or "float8" in p) and fw != "mcore":
        raise Skip("FP8 outside Megatron-Core's TransformerEngine (torchao, Composer)")
    if "fp8" in p:
        return Precision.FP8
    if p.startswith("not stated"):
        if row["source_id"] not in UNSTATED_PRECISION:
            raise Skip(f"precision not stated ({row['precision']!r})")
        assumed.append(f"{UNSTATED_PRECISION[row['source_id']]} (the source's tests of then)")
        return UNSTATED_PRECISION[row["source_id"]]
    return Precision.BF16 if "bf16" in p else Precision.FP16


# How BigScience's Megatron-DeepSpeed split BLOOM's layers (train/tr11-176B-ml): GPTModelPipe
# hard-coded "type:transformer" until --pp-partition-method (00f5f889, 2022-02-28); the
# chronicles' "Re-do" table of NLAYERS=106 ran "regex partition_method='type:transformer|embed'",
# "Rebalancing layers" on and the README's run "type:transformer|embedding". DeepSpeed was then
# before 0.12.5, so its partition_balanced bisected (zsim.workload.pipe_partition).
EMBEDDING_SLOTS = ("§ Rebalancing layers", "README.md")
RE_DO_EMBEDDING_LAYERS = 106


def pipe_split(row: dict[str, str], fw: str, layers: int) -> dict[str, str]:
    """The partition fields of a BLOOM row (other sources: Megatron's uniform split)."""
    if fw != "bloom":
        return {}
    where = row["table_figure"]
    slots = any(s in where for s in EMBEDDING_SLOTS)
    slots |= "§ Re-do" in where and layers == RE_DO_EMBEDDING_LAYERS
    method = "type:transformer|embedding" if slots else "type:transformer"
    return {"pp_partition": method, "pp_balancer": "bisect"}


def layout(row: dict[str, str], fw: str, assumed: list[str]) -> tuple[int, ...]:
    """(tp, pp, dp, cp, virtual stages, micro-batch, grad accumulation)."""
    cp = integer(row, "cp") or 1
    if cp > 1 and fw != "mcore":  # zsim models Megatron-Core's (TE's p2p ring)
        raise Skip(f"context parallelism (cp={row['cp']}) outside Megatron-Core is not modelled")
    gpus = integer(row, "num_gpus")
    tp, pp, dp = (integer(row, k) for k in ("tp", "pp", "dp"))
    if gpus is None or tp is None or pp is None:
        raise Skip("GPU count or TP/PP layout not given")
    dp = dp or gpus // (tp * pp * cp)
    if tp * pp * dp * cp != gpus:
        raise Skip(f"tp*pp*dp*cp = {tp * pp * dp * cp} != {gpus} GPUs")
    vpp = integer(row, "vpp") or implied_interleaving(row, pp, assumed)
    if vpp > 1 and pp == 1:  # Megatron-Core's initialize_model_parallel refuses it
        assumed.append(f"no interleaving (vpp {vpp} given at pp 1, which Megatron refuses)")
        vpp = 1
    batch = integer(row, "global_batch_size")
    if batch is None:
        raise Skip("global batch not given")
    micro = integer(row, "micro_batch_size")
    if micro is None and row["source_id"] == "megatron_readme_2020_09":
        micro = batch // dp  # Megatron-LM 2020 had no gradient accumulation: one micro-batch
        assumed.append(f"micro-batch {micro} (= per-replica batch)")
    if micro is None and fw in ("megatron", "mcore"):
        micro = 1
        assumed.append("micro-batch 1")
    if micro is None:
        raise Skip("micro-batch not given")
    accum, rest = divmod(batch, micro * dp)
    if rest or accum < 1:
        raise Skip(f"global batch {batch} is not a multiple of micro {micro} x dp {dp}")
    return tp, pp, dp, cp, vpp, micro, accum


def implied_interleaving(row: dict[str, str], pp: int, assumed: list[str]) -> int:
    """Megatron-LM's 2024 README overlaps "pipeline-parallel communication (enabled by
    default)" with computation, which Megatron does only with the interleaved schedule
    (`arguments.py` turns `overlap_p2p_comm` off otherwise), but gives no v: the smallest
    one core_r0.8.0 accepts (layers per stage divisible by layers per virtual stage)."""
    layers = integer(row, "num_layers")
    if row["source_id"] != "megatron_readme_2024" or pp == 1 or not layers:
        return 1
    per_stage = layers // pp
    v = next(v for v in range(2, per_stage + 1) if per_stage % v == 0)
    assumed.append(f"interleaved, v {v} (p2p overlapped; the smallest v its layers allow)")
    return v


# Sources published before the A100 80GB existed (announced at SC20, 2020-11-16: AnandTech,
# "NVIDIA Announces A100 80GB: Ampere Gets HBM2e Memory Upgrade"): an A100 whose memory they do
# not state is the 40 GB card (HBM2, 1,555 GB/s), not the 80 GB one (2,039 GB/s).
BEFORE_A100_80GB = frozenset({"megatron_readme_2020_09"})


def a100_preset(row: dict[str, str], assumed: list[str]) -> str:
    """The A100 preset of a row: its stated memory, else the card its source's date allows."""
    gpu_type = text(row, "gpu_type")
    if "40" in gpu_type:
        return "a100-40gb"
    if "80" in gpu_type:
        return "a100-80gb"
    if row["source_id"] in BEFORE_A100_80GB:
        assumed.append("A100 40GB (published before the 80GB card)")
        return "a100-40gb"
    assumed.append("A100 80GB (memory not stated)")
    return "a100-80gb"


def gpu_profile(gpu: str) -> DeviceProfile:
    """A GPU preset, or a card only the benchmark knows (its spec under benchmarks/reference/)."""
    own = REFERENCE / f"{gpu}.yaml"
    return presets.gpu(str(own) if own.is_file() else gpu)


def cluster(row: dict[str, str], notes: list[str], assumed: list[str]) -> tuple[str, int, str]:
    """(fabric preset or YAML, GPUs per node, GPU preset) closest to the row's cluster."""
    gpu_type, net = text(row, "gpu_type"), text(row, "node_interconnect")
    if "v100" in gpu_type:
        return str(REFERENCE / "dgx2-v100.yaml"), 16, "v100-32gb"
    if "a100" in gpu_type:
        gpu = a100_preset(row, assumed)
        if "jean zay" in net:
            return str(REFERENCE / "jean-zay-a100.yaml"), 8, gpu
        if "hdr ib" not in net and "selene" not in net and "dgx-a100" not in net:
            notes.append("network as DGX A100 8x200 Gb/s IB")
        return "dgx-a100", 8, gpu
    if "h100" in gpu_type:
        if "grand teton" in net:  # the card as torchtitan's docs state it
            notes.append("H100 96GB HBM2e at 2.4 TB/s; its 500 W limit not modelled")
            return "roce", 8, "h100-hbm2e-500w"
        if "eos" not in net:
            notes.append("network as DGX H100 8x400 Gb/s IB")
        return "dgx-h100", 8, "h100-sxm"
    raise Skip(f"no GPU preset for {row['gpu_type']!r}")


def sequence_parallel(row: dict[str, str], fw: str, tp: int, assumed: list[str]) -> bool:
    """As the row says; Megatron-Core's runs with TP where it does not say: on."""
    if fw == "mcore" and tp > 1 and not row.get("sequence_parallel"):
        assumed.append("sequence parallel")
        return True
    return text(row, "sequence_parallel") in ("yes", "true", "1")


def map_row(row: dict[str, str], file: str) -> Case:
    fw = framework(row)
    assumed: list[str] = []
    notes: list[str] = []
    if text(row, "offload") not in ("", "none"):
        raise Skip("CPU offload: the run's host Adam rate is not known (presets: an upper bound)")
    model = model_of(row, fw, assumed, notes)
    tp, pp, dp, cp, vpp, micro, accum = layout(row, fw, assumed)
    stage = zero_stage(row, fw, assumed)
    engines = engine_fields(fw, stage, model, tp, assumed) | pipe_split(row, fw, model.layers)
    named = text(row, "system_framework") + " " + text(row, "zero_stage_or_sharding")
    engines["knobs"] = replace(engines["knobs"], **zero_plus_plus(named))
    seq_par = sequence_parallel(row, fw, tp, assumed)
    engines["tp_comm_overlap"] &= seq_par
    if engines["tp_comm_overlap"]:
        engines["tp_overlap_sms"] = tp_overlap_sms(row, assumed)
    try:
        parallel = ParallelConfig(
            dp=dp,
            tp=tp,
            pp=pp,
            cp=cp,
            zero_stage=stage,
            micro_batch=micro,
            grad_accum=accum,
            precision=precision(row, fw, assumed),
            recompute=recompute(row, fw, assumed),
            sequence_parallel=seq_par,
            pp_schedule=PipelineSchedule.INTERLEAVED if vpp > 1 else PipelineSchedule.ONE_F_ONE_B,
            virtual_stages=vpp,
            **kernels(row, fw),
            **engines,
        )
        check_split(model, parallel)
        check_model(model, cp)
    except InputError as exc:
        raise Skip(f"zsim refuses the layout: {exc}") from None
    fabric, per_node, gpu = cluster(row, notes, assumed)
    if fw == "mpt":  # llm-foundry's Triton kernel where a rate for it exists
        parallel = replace(parallel, attention_kernel=triton_kernel(gpu))
    if pp > 1 and (model.layers % (pp * vpp) or parallel.pp_partition != "uniform"):
        held = stage_blocks(model, parallel)
        notes.append(f"{parallel.pp_partition}: stages of {', '.join(map(str, held))} blocks")
    step, source = measured(row, model)
    return Case(
        row_id=row["row_id"],
        file=file,
        source_id=row["source_id"],
        model=model,
        parallel=parallel,
        fabric=fabric,
        nodes=math.ceil(parallel.world_size / per_node),
        gpus_per_node=per_node,
        gpu=gpu,
        measured_s=step,
        measured_from=source,
        assumed=tuple(assumed),
        notes=tuple(notes),
    )
