"""HSDP across the two-node harness (200 Mbit/s link): the bytes that cross the node boundary per
step, read from the veth interface counters by ``bench train``, are within 20 % of
``parallel.data.hsdp.cross_node_bytes`` for flat ZeRO-3, HSDP ZeRO-3, flat DDP and hierarchical
DDP, and HSDP's are at most 0.6x flat ZeRO-3's. Bytes, not timings (those live in
``benchmarks/hsdp_two_nodes.py``)."""
import json
from pathlib import Path

import pytest

from zerotron.testing_netns import TwoNodes, netns_unavailable

ROOT = Path(__file__).resolve().parent.parent
WHY = netns_unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"two-node harness: {WHY}")
KIND = {"zero3": "zero3", "hsdp-zero3": "hsdp_zero", "dp": "ddp", "dp-hier": "hier_ddp"}


def _unit_params() -> tuple[int, int]:
    import torch

    from zerotron.config import load_config
    from zerotron.models.registry import build_model
    from zerotron.train.setup import gpt_config

    cfg = load_config(str(ROOT / "configs" / "tiny.toml"))
    torch.manual_seed(0)
    model = build_model(gpt_config(cfg, cfg.data.vocab_size))
    blocks = sum(p.numel() for b in model.blocks() for p in b.parameters())
    return model.num_params() - blocks, blocks


def test_cross_node_bytes_of_hsdp_and_flat_equal_theory(tmp_path):
    from zerotron.parallel.data.hsdp import cross_node_bytes

    out = tmp_path / "train.json"
    with TwoNodes(rate="200mbit") as nodes:
        res = nodes.torchrun(["-m", "zerotron", "bench", "train", "--config", "configs/tiny.toml", "--layouts",
                              ",".join(KIND), "--steps", "2", "--warmup", "1", "--rounds", "1", "--json", str(out),
                              "--train.global_batch", "4", "--train.micro_batch", "1"],
                             nproc_per_node=2, timeout_s=240, cwd=str(ROOT))
    for r in res:
        assert r.returncode == 0, f"node {r.node.index}: {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    rows = {r["layout"]: r for r in json.loads(out.read_text())}
    root, blocks = _unit_params()
    for name, kind in KIND.items():
        r = rows[name]
        assert not r["skipped"] and r["link_nodes"] == 2, r
        want = cross_node_bytes(kind, root, blocks)
        assert 0.8 * want <= r["link_tx_bytes_per_step"] <= 1.2 * want, (name, r["link_tx_bytes_per_step"], want)
    assert rows["hsdp-zero3"]["link_tx_bytes_per_step"] <= 0.6 * rows["zero3"]["link_tx_bytes_per_step"]
    assert rows["dp-hier"]["link_tx_bytes_per_step"] < rows["dp"]["link_tx_bytes_per_step"]
    assert rows["hsdp-zero3"]["link_bytes_vs_flat"] == pytest.approx(
        rows["hsdp-zero3"]["link_tx_bytes_per_step"] / rows["zero3"]["link_tx_bytes_per_step"])
