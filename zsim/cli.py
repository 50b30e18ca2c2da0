"""The `zsim` command: parse flags, build the scenario, call the core, render the result."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from zsim import presets, render
from zsim.errors import InputError
from zsim.memory import peak_ledger
from zsim.model import PRESETS
from zsim.parallel import ZeroStage, with_stage
from zsim.scenario import build_model, build_parallel, check_layout


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"zsim: error: {message} (see `{self.prog} --help`)\n")


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", help=f"preset: {', '.join(PRESETS)}")
    g.add_argument("--params", help="parameter count only (model-state ledger), e.g. 7.5e9")
    for flag in ("layers", "hidden", "heads", "ffn-hidden", "seq-len", "vocab", "kv-heads"):
        g.add_argument(f"--{flag}", metavar="N", help=f"override the preset's {flag}")


def _add_parallel_flags(p: argparse.ArgumentParser, stage: bool = True) -> None:
    g = p.add_argument_group("layout and batch")
    g.add_argument("--ds-config", type=Path, help="a DeepSpeed ds_config.json to read")
    for flag, text in (
        ("dp", "data-parallel size"),
        ("tp", "tensor-parallel size"),
        ("pp", "pipeline-parallel size"),
        ("micro-batch", "per-GPU micro-batch"),
        ("grad-accum", "gradient accumulation steps"),
        ("global-batch", "train_batch_size = micro x accum x dp"),
    ):
        g.add_argument(f"--{flag}", metavar="N", help=text)
    if stage:
        g.add_argument("--stage", help="ZeRO stage 0-3")
    g.add_argument("--precision", help="fp16, bf16 or fp32 (default fp16)")
    g.add_argument("--recompute", help="none, selective or full")
    g.add_argument("--offload", help="none, optimizer or optimizer+params")
    g.add_argument("--sequence-parallel", action="store_true", default=None)
    g.add_argument("--flash-attention", action="store_true", default=None)
    g.add_argument("--pp-schedule", help="gpipe, 1f1b or interleaved")
    g.add_argument("--virtual-stages", metavar="V", help="model chunks per rank (interleaved)")
    k = p.add_argument_group("DeepSpeed knobs (elements, as in ds_config)")
    for knob in (
        "reduce-bucket-size",
        "allgather-bucket-size",
        "prefetch-bucket-size",
        "param-persistence-threshold",
        "max-live-parameters",
        "max-reuse-distance",
    ):
        k.add_argument(f"--{knob}", metavar="N")
    k.add_argument("--overlap-comm", action=argparse.BooleanOptionalAction, default=None)


def _model_from(args: argparse.Namespace) -> Any:
    return build_model(
        args.model,
        args.params,
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        ffn_hidden=args.ffn_hidden,
        seq_len=args.seq_len,
        vocab=args.vocab,
        kv_heads=args.kv_heads,
    )


def _parallel_from(args: argparse.Namespace, **extra: Any) -> Any:
    flags = {
        k: getattr(args, k, None)
        for k in (
            "dp",
            "tp",
            "pp",
            "micro_batch",
            "grad_accum",
            "global_batch",
            "stage",
            "precision",
            "recompute",
            "offload",
            "sequence_parallel",
            "flash_attention",
            "pp_schedule",
            "virtual_stages",
            "reduce_bucket_size",
            "allgather_bucket_size",
            "prefetch_bucket_size",
            "param_persistence_threshold",
            "max_live_parameters",
            "max_reuse_distance",
            "overlap_comm",
        )
    }
    return build_parallel(args.ds_config, **(flags | extra))


# ---- commands ------------------------------------------------------------------------------


def cmd_memory(args: argparse.Namespace) -> int:
    model = _model_from(args)
    cfg = _parallel_from(args)
    check_layout(model, cfg)
    device = presets.gpu(args.gpu)
    ledgers = {s: peak_ledger(model, with_stage(cfg, s)) for s in ZeroStage}
    report = render.memory_report(model, cfg, device, ledgers)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        render.print_memory(report)
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    rows = [render.model_row(m) for m in PRESETS.values()]
    print(json.dumps(rows, indent=2)) if args.json else render.print_rows(rows, "Model presets")
    return 0


def cmd_gpus(args: argparse.Namespace) -> int:
    rows = [render.gpu_row(presets.gpu(n)) for n in presets.gpu_names()]
    print(json.dumps(rows, indent=2)) if args.json else render.print_rows(rows, "GPU presets")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="zsim", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    from zsim.calibrate import cli as calibrate_cli

    calibrate_cli.add_commands(sub)
    from zsim import cli_network

    cli_network.add_commands(sub)
    from zsim.validate import cli as validate_cli

    validate_cli.add_commands(sub)

    mem = sub.add_parser("memory", help="memory ledger per GPU for ZeRO stages 0-3")
    _add_model_flags(mem)
    _add_parallel_flags(mem, stage=False)
    mem.add_argument("--gpu", default="a100-80gb", help="GPU preset (see `zsim gpus`)")
    mem.add_argument("--json", action="store_true", help="machine-readable output")
    mem.set_defaults(func=cmd_memory)

    for name, func, text in (
        ("models", cmd_models, "list model presets"),
        ("gpus", cmd_gpus, "list GPU presets"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument("--json", action="store_true")
        p.set_defaults(func=func)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except InputError as exc:
        print(f"zsim: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("zsim: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
