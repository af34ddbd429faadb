"""The generated layout matrix (``zerotron.parity``): every layout config validation accepts trains
like one process in float64 (rtol 1e-10, copies bitwise equal); every layout it refuses is refused
for a documented reason.

By default one pairwise covering array of the valid layouts over both model families runs, the
family one more factor (every pair of factor values, (family, value) pairs included, at least once;
``parity.joint_covering``); ``ZEROTRON_MATRIX=full`` (``make test-matrix``) runs every valid layout, and
``ZEROTRON_MATRIX_OUT=path.json`` writes the per-layout worst errors. The layouts of one world size
run in a few run_ranks calls (chunks of CHUNK layouts, on run_ranks' pooled ranks), shared by
both model families."""
import dataclasses
import itertools
import json
import os
import time
from collections import defaultdict

import pytest
import torch

from zerotron import parity
from zerotron.testing import run_ranks

FULL = os.environ.get("ZEROTRON_MATRIX", "") == "full"
# ZEROTRON_MATRIX_WORLDS=8,4: only these world sizes (a long full run in parts).
WORLDS = {int(w) for w in os.environ.get("ZEROTRON_MATRIX_WORLDS", "").split(",") if w.strip()}
# ZEROTRON_MATRIX_SCHEDULES=zb-v: only the pipeline layouts of these schedules (a new schedule's part)
SCHEDULES = {s.strip() for s in os.environ.get("ZEROTRON_MATRIX_SCHEDULES", "").split(",") if s.strip()}
# ZEROTRON_MATRIX_NAMES=r2-pp,zb-v: only the layouts whose name contains one of these (a new combination's part)
NAMES = [s.strip() for s in os.environ.get("ZEROTRON_MATRIX_NAMES", "").split(",") if s.strip()]
CHUNK = 24  # layouts per run_ranks call: a hung call costs at most one chunk, progress is saved per chunk; the
# pooled ranks serve the next chunk (benchmarks/suite_speed_s11.md: they no longer retire with leaked gloo threads)


def _partial(out: str | None, family: str) -> tuple[str | None, dict]:
    """The progress file of an interrupted run with ZEROTRON_MATRIX_OUT (one JSON record per checked
    layout, same tree assumed) and the records already in it, so a rerun checks only the rest."""
    if not out:
        return None, {}
    path = os.path.splitext(out)[0] + f"_{family}.partial.jsonl"
    return path, parity.read_progress(path)


@pytest.fixture(scope="module")
def split():
    """(valid, refused {layout: message}) of the full product."""
    valid, refused = [], {}
    for lay in parity.all_layouts():
        msg = parity.refusal(lay)
        if msg is None:
            valid.append(lay)
        else:
            refused[lay] = msg
    return valid, refused


def test_progress_file_survives_a_torn_append(tmp_path):
    """`make test-matrix-cp` resumes from its progress file: a last line torn by a kill during the
    append was a JSONDecodeError traceback at collection (no resume without hand-editing); it is cut
    off now (the next append starts a line of its own) and a damaged line elsewhere is one line
    naming the file, the line and the fix."""
    path = tmp_path / "p.partial.jsonl"
    ok = ", ".join(f'"{k}": 0.0' for k in parity.ERRORS)  # a passing record's worst errors
    a, b = f'{{"name": "a", {ok}}}\n', f'{{"name": "b", {ok}}}\n'
    path.write_text(a + b + '{"name": "c", "x"')
    assert list(parity.read_progress(str(path))) == ["a", "b"]
    assert path.read_text() == a + b
    path.write_text(a + '{"name": "f", "error": "diverged"}\n')  # a failed layout's record: rerun by its caller
    assert list(parity.read_progress(str(path))) == ["a", "f"]
    for bad in (a + '{"nam\n' + b, a + '[1, 2]\n', '{"x": 1}\n',
                # a passing record without its errors, or with a NaN one, counted as checked and failed (or
                # took the NaN) only in the report after the whole run
                a + '{"name": "b"}\n', a + f'{{"name": "b", {ok.replace("0.0", "NaN", 1)}}}\n'):
        path.write_text(bad)
        with pytest.raises(ValueError, match=r"p.partial.jsonl, line \d: not a layout record .*delete that line"):
            parity.read_progress(str(path))
        assert path.read_text() == bad  # nothing changed on disk


def test_refusals_are_the_documented_ones(split, report):
    valid, refused = split
    for lay in valid:
        assert parity.expected_refusal(lay) is None, f"{lay.name} runs but is documented as refused"
    for lay, msg in refused.items():
        assert parity.expected_refusal(lay) is not None, f"{lay.name} is refused unexpectedly: {msg}"
        assert msg and "\n" not in msg and ("parallel." in msg or "train." in msg), (lay.name, msg)
    assert len(valid) + len(refused) == len(parity.all_layouts())
    docs = parity.doc_mask_layouts(valid)  # the document-masking witnesses: valid layouts, run with the masks
    assert len(docs) == len(parity.DOC_MASK) and all(parity.refusal(lay) is None for lay in docs)
    loras = parity.lora_layouts(valid)  # the LoRA witnesses: valid layouts, run with adapters
    assert len(loras) == len(parity.LORA) and all(parity.refusal(lay) is None for lay in loras)
    lora_cp = dataclasses.replace(next(lay for lay in valid if lay.cp > 1), lora=True)
    assert parity.refusal(lora_cp) and parity.expected_refusal(lora_cp)  # LoRA x cp: refused, documented
    offs = parity.offload_layouts(valid)  # the optimizer-offload witnesses: valid layouts, run with offload
    assert len(offs) == len(parity.OFFLOAD) and all(parity.refusal(lay) is None for lay in offs)
    report(f"parity matrix: {len(valid) + len(refused)} layouts <= {parity.MAX_WORLD} processes, "
           f"{len(valid)} valid, {len(refused)} refused (each for a documented reason)")


def test_covering_array_covers_every_pair(split):
    """The joint covering array (the model family as one more factor) holds every pair of
    (factor, value) assignments of ``families x valid layouts`` -- (family, value) pairs included,
    so each family sees every value of every factor -- and every MUST witness in its families;
    so does the one-family array (``covering_layouts``, the MoE family's)."""
    valid, _ = split
    keys = list(parity.FACTORS)

    def pairs(family, lay):
        v = ([("family", family)] if family else []) + [(k, getattr(lay, k)) for k in keys]
        return set(itertools.combinations(v, 2))

    cover = parity.joint_covering(valid)
    want1 = set().union(*(pairs(None, lay) for lay in valid))  # the valid layouts are the same in every family
    want = want1 | {(("family", f), a) for f in parity.MODELS for a in {a for p in want1 for a in p}}
    assert set().union(*(pairs(f, lay) for f, lay in cover)) == want
    assert len(set(cover)) == len(cover) and all(f in parity.MODELS for f, _ in cover)
    witnesses = {(f, lay) for lay in valid if lay.name in parity.MUST for f in parity.witness_families(lay)}
    assert len({lay.name for _, lay in witnesses}) == len(parity.MUST) and witnesses <= set(cover)
    assert len(cover) < len(valid) / 4, (len(cover), len(valid))
    for f in parity.MODELS:  # every value of every factor in each family, including the 8-process 3-D layouts
        for k in keys:
            assert {getattr(lay, k) for lay in valid} == {getattr(lay, k) for g, lay in cover if g == f}, (f, k)
    one = parity.covering_layouts(valid)
    assert set().union(*(pairs(None, lay) for lay in one)) == want1


def _out(family: str) -> str | None:
    out = os.environ.get("ZEROTRON_MATRIX_OUT")
    return out.replace(".json", f"_{family}.json") if out and family != "gpt2" else out


@pytest.fixture(scope="module")
def matrix_runs(split, data_cache, single_process, tmp_path_factory):
    """{family: per-layout summaries} of every chosen layout of every model family. Both families'
    layouts of one world size share each run_ranks call (chunks of CHUNK layouts, largest world
    first), so the ranks import torch once for both. The document-masking witnesses
    (``parity.DOC_MASK``) train on the short-document corpus against a reference with the masks."""
    valid, _ = split
    lora_names = parity.LORA if FULL or os.environ.get("ZEROTRON_SFT_FULL") else parity.LORA_CI
    witnesses = parity.doc_mask_layouts(valid) + parity.lora_layouts(valid, lora_names) + parity.offload_layouts(valid)
    chosen = {family: list(valid) if FULL else [] for family in parity.MODELS}
    for family, lay in ([] if FULL else parity.joint_covering(valid)):  # one array, the family a factor
        chosen[family].append(lay)
    for family, lays in chosen.items():
        lays += witnesses
        if WORLDS:
            lays[:] = [lay for lay in lays if lay.world in WORLDS]
        if SCHEDULES:
            lays[:] = [lay for lay in lays if lay.schedule in SCHEDULES]
        if NAMES:
            lays[:] = [lay for lay in lays if any(n in lay.name for n in NAMES)]
    tmp = tmp_path_factory.mktemp("matrix")
    docs = {"data.corpus": "files", "data.path": parity.doc_corpus(str(tmp / "docs.jsonl")), "data.doc_mask": "true"}
    fam, summaries, by_world = {}, {}, defaultdict(list)
    for family in parity.MODELS:
        partial, done = _partial(_out(family), family)
        summaries[family] = [done[lay.name] for lay in chosen[family] if lay.name in done]
        for dm, lora in sorted({(lay.doc_mask, lay.lora) for lay in chosen[family]}):
            key = (family, dm, lora)  # a job: the family's layouts with or without document masking, LoRA
            extra = {"data.cache_dir": data_cache, **parity.MODELS[family], **(docs if dm else {}),
                     **(parity.LORA_TRAIN if lora else {})}
            ref = parity.reference(str(tmp / f"reference-{family}-{dm}-{lora}"), extra)
            assert lora or ref["norms"][0] > 0.5  # train.grad_clip = 0.5: clipping is active
            assert any(".self_attn.q_proj." in k for k in ref["params"]) == (family == "llama"), sorted(ref["params"])[:4]
            if lora:  # adapters only in the optimizer; the base weights as initialised (checked per layout)
                assert ref["optim"] and all(".lora_" in k for k in ref["optim"]), sorted(ref["optim"])[:4]
            ref_path = str(tmp / f"reference-{family}-{dm}-{lora}.pt")
            torch.save(ref, ref_path)
            fam[key] = (extra, ref_path, (set(ref["params"]), set(ref["optim"])), partial)
        for lay in chosen[family]:
            if lay.name not in done:
                by_world[lay.world].append(((family, lay.doc_mask, lay.lora), lay.as_dict()))
    for world, items in sorted(by_world.items(), key=lambda kv: -kv[0]):  # the largest (slowest) first
        for c in range(0, len(items), CHUNK):
            part = items[c:c + CHUNK]
            names = [key for key in fam if any(f == key for f, _ in part)]
            jobs = [([d for f, d in part if f == key], fam[key][1], str(tmp / f"{key[0]}-{key[1]}-{key[2]}-w{world}-{c}"),
                     fam[key][0]) for key in names]
            t_chunk = time.time()
            if world == 1:  # in this process (world-size-1 group)
                per_rank = [parity.run_jobs(jobs)]
            else:
                per_rank = run_ranks(parity.run_jobs, world, jobs, timeout_s=120,
                                     join_timeout_s=60 * len(part) + 300)
            per_layout = round((time.time() - t_chunk) / len(part), 2)  # chunk time per layout
            for j, (key, (lays, *_)) in enumerate(zip(names, jobs)):
                new = []
                for i, d in enumerate(lays):
                    records = [per_rank[r][j][i] for r in range(world)]
                    assert all(rec["name"] == d["name"] for rec in records)
                    new.append({**d, **parity.check(d["name"], records, fam[key][2], parity.FP64_RTOL),
                                "seconds": per_layout})
                summaries[key[0]] += new
                if fam[key][3]:
                    with open(fam[key][3], "a") as f:
                        f.writelines(json.dumps(x) + "\n" for x in new)
    return {family: (sorted(summaries[family], key=lambda x: (x["world"], x["name"])), len(chosen[family]),
                       next(v[3] for k, v in fam.items() if k[0] == family))
            for family in parity.MODELS}


@pytest.mark.parametrize("family", list(parity.MODELS))
def test_fp64_layout_matrix(family, split, matrix_runs, report):
    """Every chosen layout of model family ``family`` trains like one process (fp64, rtol 1e-10)."""
    valid, refused = split
    summaries, n_chosen, partial = matrix_runs[family]
    out = _out(family)
    seconds = sum(s.get("seconds", 0) for s in summaries)  # this run plus the resumed parts
    worst = {k: max(s[k] for s in summaries) for k in parity.ERRORS}
    report(f"parity matrix, {family} ({'full' if FULL else 'joint pairwise covering array'}): {len(summaries)} of "
           f"{len(valid)} valid layouts checked in fp64 ({len(refused)} refused), "
           f"worst relative error {max(worst.values()):.3g} ({worst}), {seconds:.0f} s (spawns shared by the families)")
    assert len(summaries) == n_chosen
    if out and not WORLDS:
        with open(out, "w") as f:
            mode = ("full" if FULL else "covering") + (f" (schedules {','.join(sorted(SCHEDULES))})" if SCHEDULES else "")
            json.dump({"model": family, "mode": mode, "valid": len(valid), "refused": len(refused),
                       "checked": len(summaries), "worst": worst, "seconds": round(seconds, 1),
                       "layouts": summaries,
                       "refusals": {l.name: m for l, m in sorted(refused.items())}}, f, indent=1)
        with open(out) as f:
            md = parity.markdown(json.load(f))
        with open(os.path.splitext(out)[0] + ".md", "w") as f:
            f.write(md)
        os.remove(partial) if partial and os.path.exists(partial) else None


FP32_SMOKE = ("ddp-dp2-acc1", "zero3-dp2-acc4", "torch_ddp-dp2-acc4", "ddp-dp1-tp2sp-acc1", "ddp-dp1-pp2-1f1b-acc4")
NOISE_FACTOR = 20  # allowed multiple of the measured fp32 noise floor (see test docstring)


def test_fp32_smoke_within_measured_noise_floor(data_cache, single_process, tmp_path, report):
    """fp32 has no exact answer: summation order changes the last bits, and which order depends on
    the CPU's kernels (AVX2 vs AVX-512). So the tolerance is *measured*: the noise floor is the
    error between two single-process runs that are mathematically equal (one micro-batch of 16 vs
    accumulation over 4 micro-batches of 4), taken per family (scalars: losses, norms, val;
    tensors: parameters, Adam moments); a layout passes within NOISE_FACTOR x that floor. A wrong
    layout (fp64 shows >= 1e-7 relative even after 2 steps) is orders of magnitude above it."""
    extra = {"data.cache_dir": data_cache, "train.dtype": "fp32"}
    ref = parity.reference(str(tmp_path / "ref"), extra)
    ref_path = str(tmp_path / "ref.pt")
    torch.save(ref, ref_path)
    split = parity.Layout("ddp", 1, 1, False, 1, None, 4)
    floor_rec = parity.run_many([split.as_dict()], ref_path, str(tmp_path / "floor"), extra)[0]
    scal = ("loss_err", "norm_err", "val_err")
    tens = ("param_err", "optim_err", "full_err")
    floor = {"scalars": max(floor_rec[k] for k in scal), "tensors": max(floor_rec[k] for k in tens)}
    assert 0 < floor["scalars"] and 0 < floor["tensors"] < 1e-4, floor  # a real, small fp32 floor
    lays = [l.as_dict() for l in parity.all_layouts() if l.name in FP32_SMOKE]
    assert len(lays) == len(FP32_SMOKE)
    per_rank = run_ranks(parity.run_many, 2, lays, ref_path, str(tmp_path / "w2"), extra, timeout_s=120)
    ratios = {}
    fam = {k: ("scalars" if k in scal else "tensors") for k in scal + tens}
    tol = {k: NOISE_FACTOR * floor[f] for k, f in fam.items()}
    for i, d in enumerate(lays):
        recs = [per_rank[r][i] for r in range(2)]
        parity.check(d["name"], recs, (set(ref["params"]), set(ref["optim"])), tol)
        ratios[d["name"]] = max(max(r[k] for r in recs) / max(floor[fam[k]], 1e-300) for k in fam)
    report(f"fp32 smoke: noise floor {floor}; worst layout error / floor: "
          + ", ".join(f"{k} {v:.2g}" for k, v in ratios.items()))


def test_kept_meshes_keep_dtensor_caches_only_while_no_mesh_names_a_destroyed_group(single_process):
    """run_many keeps DTensor's sharding caches across layouts (MeshCache) unless a surviving
    DeviceMesh names a group the layout destroyed (a stale cache hit would name it): the check
    sees a mesh over a destroyed group, and not one over a live group."""
    import gc

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    from torch.distributed.device_mesh import DeviceMesh

    from zerotron.parity.runs import _meshes_name

    gc.collect()
    pg = dist.new_group([0])
    name = c10d._world.pg_names[pg]
    mesh = DeviceMesh.from_group(pg, "cpu")
    gc.collect()  # the mesh is now a survivor of the oldest generation, as after a layout
    assert _meshes_name({name}) and not _meshes_name({"no-such-group"}) and not _meshes_name(set())
    dist.destroy_process_group(pg)
    assert _meshes_name({name})  # still alive (e.g. through a cache): the caches must be cleared
    del mesh
    gc.collect()
    assert not _meshes_name({name})
