"""DeepSpeed's pipeline partition methods, against DeepSpeed and BigScience.

Expected values: DeepSpeed's own unit tests of `partition_balanced` (tests/unit/
runtime/utils/test_partition.py, the same cases at v0.6.0 and at 0.19), DeepSpeed 0.19's
installed function itself, and BigScience's tr11 chronicles (train/tr11-176B-ml/
chronicles-prequel.md): "Re-do" ("78/12=6.5 - so the last stage has 1 block, while the rest
have 7", DeepSpeed 0.5-0.6's bisecting balancer with Megatron-DeepSpeed's "type:transformer")
and "Rebalancing layers" ("type:transformer|embedding ... to match 2+nlayers*PP math to get a
perfect balance giving each embedding layer its own slot").
"""

import json
import random
from dataclasses import replace

import pytest

from zsim.cli import main
from zsim.errors import InputError
from zsim.inputs.scenario import check_layout
from zsim.memory import stage_params
from zsim.workload.layout import StageSplit, stage_blocks, stage_layers
from zsim.workload.model import LayerKind
from zsim.workload.model_presets import preset, with_overrides
from zsim.workload.parallel import ParallelConfig, PipelineEngine, PipelineSchedule
from zsim.workload.pipe_partition import Balancer, PartitionMethod, balanced_bounds

BOTH = (Balancer.DP, Balancer.BISECT)
GPT = preset("gpt-1.3b")


def bloom(layers: int):
    """BLOOM's shape at tr11's width (h 14336, 112 heads, V 250880)."""
    return with_overrides(GPT, layers=layers, hidden=14336, heads=112, vocab=250880)


def split(layers: int, pp: int, method: str, balancer: str = "dp") -> tuple[int, ...]:
    cfg = ParallelConfig(pp=pp, zero_stage=1, pp_partition=method, pp_balancer=balancer)
    return stage_blocks(bloom(layers), cfg)


@pytest.mark.parametrize("balancer", BOTH)
@pytest.mark.parametrize(
    ("weights", "parts", "expected"),
    [
        ([0, 1, 2, 3, 3, 3], 4, [0, 3, 4, 5, 6]),  # test_int_balanced
        ([0.0, 1.1, 1.9, 3.0, 3.0, 3.0], 4, [0, 3, 4, 5, 6]),  # test_float_balanced
        ([0.0, 1.1, 30, 3.0], 3, [0, 2, 3, 4]),  # test_float_midheavy
        ([1] * 8, 4, [0, 2, 4, 6, 8]),  # test_easy_balance_balanced: every part 2
        ([1] * 2, 4, [0, 1, 2, 2, 2]),  # test_short_partition: one item a part, then none
    ],
)
def test_balancers_pass_deepspeeds_own_partition_tests(weights, parts, expected, balancer):
    assert list(balanced_bounds(weights, parts, balancer)) == expected


def test_the_bisecting_balancer_leaves_bloom_78_layers_one_block_on_the_last_of_12_stages():
    assert split(78, 12, "type:transformer", "bisect") == (7,) * 11 + (1,)


def test_the_dp_balancer_spreads_the_same_78_blocks_7_and_6():
    # DeepSpeed 0.19's partition_balanced([1] * 78, 12): [0, 7, ..., 42, 48, ..., 72, 78]
    assert split(78, 12, "type:transformer", "dp") == (7,) * 6 + (6,) * 6


@pytest.mark.parametrize("balancer", BOTH)
@pytest.mark.parametrize(("layers", "pp"), [(70, 12), (82, 12), (94, 12), (106, 12), (100, 6)])
def test_each_embedding_takes_a_blocks_slot_when_layers_plus_two_divide_by_pp(layers, pp, balancer):
    per = (layers + 2) // pp
    expected = (per - 1,) + (per,) * (pp - 2) + (per - 1,)
    assert split(layers, pp, "type:transformer|embedding", balancer) == expected


def test_uniform_gives_the_first_stages_the_remainder():
    # DeepSpeed >= 0.10.1's partition_uniform (#4053): residual items one each to the first
    assert split(70, 12, "uniform") == (6,) * 10 + (5,) * 2


def test_the_dp_balancer_matches_deepspeeds_installed_one():
    utils = pytest.importorskip("deepspeed.runtime.utils", reason="deepspeed: calibrate extra")
    rng = random.Random(7)
    for _ in range(150):
        n, parts = rng.randint(1, 30), rng.randint(1, 9)
        weights = [rng.choice([0, 1, 2, 5, 12596224, 52559872]) for _ in range(n)]
        if not any(weights):
            continue
        theirs = [int(b) for b in utils.partition_balanced(weights, parts)]
        assert list(balanced_bounds(weights, parts, Balancer.DP)) == theirs, (weights, parts)


@pytest.mark.parametrize("method", list(PartitionMethod))
@pytest.mark.parametrize("balancer", BOTH)
def test_every_module_is_held_once_and_the_tied_copy_sits_with_the_head(method, balancer):
    """A consistency check of the placement, whatever the split."""
    model, pp = bloom(30), 4
    cfg = ParallelConfig(pp=pp, zero_stage=1, pp_partition=method, pp_balancer=balancer)
    stages = [stage_layers(model, pp, s, StageSplit.of(cfg)) for s in range(pp)]
    held = [x for stage in stages for x in stage if x.kind is not LayerKind.TIED_COPY]
    assert held == list(model.layer_list())
    assert stages[0][0].kind is LayerKind.EMBEDDING
    assert [x.kind for x in stages[-1][-2:]] == [LayerKind.HEAD, LayerKind.TIED_COPY]
    assert sum(stage_blocks(model, cfg)) == 30


def test_parameters_weighs_both_embeddings_as_deepspeed_builds_them():
    # a 250880 x 14336 embedding per end outweighs 3 blocks (12 h^2 each): the end stages
    # take fewer blocks than the middle ones
    held = split(30, 4, "parameters")
    assert held[0] < held[1]
    assert held[-1] < held[-2]
    assert sum(held) == 30


def test_a_split_that_empties_a_stage_is_refused():
    cfg = ParallelConfig(pp=8, zero_stage=1, pp_partition="type:transformer", pp_balancer="bisect")
    with pytest.raises(InputError, match="stage 7 holds none"):
        check_layout(bloom(26), cfg)  # bottleneck 4: six stages of 4, one of 2, one empty


def test_type_methods_need_transformer_blocks():
    cfg = ParallelConfig(pp=2, zero_stage=1, pp_partition="type:transformer")
    with pytest.raises(InputError, match="without transformer blocks"):
        check_layout(preset("toy-mlp"), cfg)


def test_megatrons_schedules_split_uniformly_only():
    with pytest.raises(InputError, match="pp_partition"):
        ParallelConfig(
            pp=2,
            pp_partition="parameters",
            pipeline_engine=PipelineEngine.MEGATRON,
            pp_schedule=PipelineSchedule.GPIPE,
        )


def test_giving_the_embedding_a_slot_takes_one_block_off_the_first_stage():
    """70 layers over 12 stages: uniform gives stage 0 the embedding and 6 blocks,
    "type:transformer|embedding" the embedding and 5: one block's parameters fewer, 12h^2 + 13h
    (Narayanan et al. 2021, section 5.1's count per layer)."""
    model, h = bloom(70), 14336
    held = {
        method: stage_params(model, 12, 1, 0, 1, StageSplit(PartitionMethod(method)))
        for method in ("uniform", "type:transformer|embedding")
    }
    assert held["uniform"] - held["type:transformer|embedding"] == 12 * h * h + 13 * h


def test_a_run_says_how_its_stages_are_split(capsys):
    flags = ["--topology", "1x8-dgx-a100", "--model", "gpt-1.3b:layers=26", "--pp", "4", "--json"]
    method = ["--pp-partition-method", "type:transformer", "--pp-balancer", "bisect"]
    assert main(["run", *flags, *method]) == 0
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert "pipeline stages hold 7, 7, 7, 5 blocks (type:transformer, bisect)" in notes


def test_megatron_deepspeeds_default_on_todays_deepspeed_is_zsims_uniform():
    """Binary block weights under the DP balancer give the first stages the remainder, as
    partition_uniform does: zsim's default split is Megatron-DeepSpeed's on DeepSpeed >=
    0.12.5 (checked against DeepSpeed's function above)."""
    for blocks in range(1, 90, 7):
        for pp in range(1, min(blocks, 24) + 1):
            cfg = ParallelConfig(pp=pp, zero_stage=1, pp_partition="type:transformer")
            dp = stage_blocks(bloom(blocks), cfg)
            assert dp == stage_blocks(bloom(blocks), replace(cfg, pp_partition="uniform"))
