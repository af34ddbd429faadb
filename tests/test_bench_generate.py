"""``zerotron bench generate`` on 2 ranks, tiny sizes: the JSON rows have the documented schema,
every layout's outputs are equal, weights per rank equal the memory estimator's prediction, KV
cache per rank is as the layout implies (no timings are checked)."""
import json
import os

from zerotron.testing import ROOT
from zerotron.testing_cli import run_cli

ROW = ("layout", "output_tokens_per_s", "ttft_s", "tpot_s_p50", "tpot_s_p95", "weight_bytes_per_rank",
       "kv_cache_bytes_per_rank", "busy_fraction")


def test_bench_generate_json(tmp_path):
    out = tmp_path / "g.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    p = run_cli(["bench", "generate", "--nproc", "2", "--prompts", "5",  # fork-server child
                 "--new-tokens", "4", "--rounds", "2", "--baseline-prompts", "2", "--json", str(out),
                 "--markdown", str(tmp_path / "g.md")], cwd=ROOT, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = {r["layout"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"single", "dp", "naive-mp", "pp", "tp", "pp-tp", "pp-nocache"}
    assert rows["pp-tp"]["skipped"] and "N >= 4" in rows["pp-tp"]["error"]
    ok = {k: r for k, r in rows.items() if not r["skipped"]}
    for name, r in ok.items():
        assert all(k in r for k in ROW), (name, r)
        assert r["output_tokens_per_s"] > 0 and r["tpot_s_p50"] <= r["tpot_s_p95"] and r["rounds"] == 2
        assert r["outputs_equal_across_layouts"] is True
        assert len(r["busy_fraction"]) == len(r["weight_bytes_per_rank"]) == r["world_size"]
    # measured storage per rank == the memory estimator's stage_num_params x 4 bytes, every layout
    for name, r in ok.items():
        assert r["weight_bytes_per_rank"] == r["estimated_weight_bytes_per_rank"], name
    single = ok["single"]["weight_bytes_per_rank"][0]
    assert ok["dp"]["weight_bytes_per_rank"] == [single, single]
    assert all(0.45 * single < w < 0.55 * single for w in ok["tp"]["weight_bytes_per_rank"])  # heads + vocab split
    assert all(0.5 * single < w < single for w in ok["pp"]["weight_bytes_per_rank"])  # tied embedding on both ends
    kv = ok["single"]["kv_cache_bytes_per_rank"][0]
    assert ok["tp"]["kv_cache_bytes_per_rank"] == [kv // 2] * 2 == ok["naive-mp"]["kv_cache_bytes_per_rank"]
    # micro-batches are padded to their own longest prompt: at most half of the single-batch cache
    assert all(0 < b <= kv // 2 for b in ok["pp"]["kv_cache_bytes_per_rank"])
    assert ok["pp"]["microbatches"] == 2 and ok["naive-mp"]["microbatches"] == 1
    assert all(0 < c for r in ok.values() if r["layout"] != "pp-nocache" for c in r["cpu_fraction"])
    assert "| pp |" in (tmp_path / "g.md").read_text()


def test_estimator_follows_a_custom_stage_split():
    import pytest

    from zerotron.analysis.flops import num_params
    from zerotron.analysis.memory import stage_num_params
    from zerotron.models.registry import build_model, preset_config

    cfg = preset_config("tiny", n_layer=4, n_head=4, n_embd=128, block_size=128, vocab_size=4096)
    model = build_model(cfg)
    block = sum(p.numel() for p in model.blocks()[0].parameters())
    even, skew = stage_num_params(cfg, 1, 2), stage_num_params(cfg, 1, 2, layer_counts=[3, 1])
    assert skew == [even[0] + block, even[1] - block]
    assert sum(skew) == num_params(cfg) + cfg.vocab_size * cfg.n_embd  # the tied copy on the last stage
    with pytest.raises(ValueError, match="layer_counts"):
        stage_num_params(cfg, 1, 2, layer_counts=[4, 1])
