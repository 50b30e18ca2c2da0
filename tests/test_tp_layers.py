"""Megatron-style TP shards (`zsim.testbed.tp_layers`) against the unsplit model: two gloo ranks
holding the halves of `torchmodels.Decoder`'s weights compute its loss and its gradients (the
independent truth is the unsplit model, autograd's own cross-entropy included)."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the TP layers need torch (the calibrate extra)")

from torch import multiprocessing as mp  # noqa: E402

from zsim.workload.model import ModelKind, ModelSpec  # noqa: E402

SPEC = ModelSpec(
    name="tiny", kind=ModelKind.TRANSFORMER, layers=2, hidden=32, heads=4, ffn_hidden=64,
    seq_len=8, vocab=37, dropout=False,
)  # fmt: skip
TP = 2


def _split(full: dict, rank: int) -> dict:
    """The unsplit weights as rank `rank`'s Megatron shard holds them."""
    from zsim.testbed.tp_layers import vocab_range

    h, kv, out = SPEC.hidden, SPEC.n_kv_heads * SPEC.head_dim, {}
    start, end = vocab_range(SPEC.vocab, TP, rank)
    for name, w in full.items():
        if name == "embedding.wte.weight":
            shard = torch.zeros(-(-SPEC.vocab // TP), h)
            shard[: end - start] = w[start:end]
            out[name] = shard
        elif ".qkv." in name:
            q, k, v = w.split([h, kv, kv], dim=0)
            out[name] = torch.cat([t.chunk(TP, dim=0)[rank] for t in (q, k, v)], dim=0)
        elif ".fc1." in name:
            out[name] = w.chunk(TP, dim=0)[rank]
        elif name.endswith(("proj.weight", "fc2.weight")):
            out[name] = w.chunk(TP, dim=1)[rank]
        elif name.endswith(("proj.bias", "fc2.bias")):
            out[name.replace(".bias", "_bias")] = w
        else:
            out[name] = w
    return out


def _rank(rank: int, port: int, full: dict, idx, targets, out: str) -> None:
    import torch.distributed as dist

    from zsim.testbed.tp_layers import TpDecoder

    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    dist.init_process_group("gloo", rank=rank, world_size=TP)
    model = TpDecoder(SPEC, TP, rank, dist.new_group([0, 1]))
    model.load_state_dict(_split(full, rank))
    loss = model(idx, targets)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    torch.save({"loss": loss.detach(), "grads": grads}, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_tp_shards_compute_the_unsplit_loss_and_gradients(tmp_path: Path) -> None:
    from zsim.testbed.torchmodels import Decoder

    torch.manual_seed(0)
    full_model = Decoder(SPEC)
    full = {k: v.detach().clone() for k, v in full_model.state_dict().items()}
    idx = torch.randint(0, SPEC.vocab, (3, SPEC.seq_len))
    targets = torch.randint(0, SPEC.vocab, (3, SPEC.seq_len))
    loss = full_model(idx, targets)
    loss.backward()
    want = {n: p.grad for n, p in full_model.named_parameters()}
    sys.path.insert(0, str(Path(__file__).parent))
    mp.spawn(_rank, args=(_free_port(), full, idx, targets, str(tmp_path)), nprocs=TP)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(TP)]
    for r in ranks:
        assert torch.allclose(r["loss"], loss.detach(), atol=1e-5)
    for rank, r in enumerate(ranks):
        split = _split(want, rank)
        assert set(split) == set(r["grads"])
        for name, grad in r["grads"].items():
            assert torch.allclose(grad, split[name], atol=1e-5), name
