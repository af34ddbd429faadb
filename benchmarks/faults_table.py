"""The fault table of issue 13: every fault a cluster throws at a run, reproduced for real on a
2-process `zerotron train` of configs/tiny.toml (8 steps, a checkpoint every 3, dropout 0.1 so
the RNG state matters), and what follows:

- **what the user sees**: the exit code and zerotron's own line on stderr;
- **lost steps**: the newest step reached before the fault minus the step the run resumes from
  (the work that must be done again);
- **resume equal**: after ``--resume`` to the end, are the per-step losses and the final model and
  optimizer state bitwise equal to an uninterrupted run?
- **time to error** for a dead (kill -9) or hung (SIGSTOP) rank: seconds from the fault until
  the run stops with its error.

Usage: ``python benchmarks/faults_table.py [--out benchmarks/faults_cpu] [--only NAME,...]``
(writes NAME.json and NAME.md; a few minutes on 2 cores). Signals, kill -9 and SIGSTOP are real
(sent from here to the launcher, its process group or one worker); one full disk is the trainer's
injected ENOSPC, the others a real tmpfs in a user + mount namespace (``unshare -rm``; those rows
say "skipped" where it cannot be mounted). *lines* counts zerotron's own lines on stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
STEPS, EVERY = 8, 3


def base(run: Path, cache: str, *extra: str) -> list[str]:
    return ["train", "--config", "configs/tiny.toml", "--nproc", "2", "--run-dir", str(run),
            "--train.steps", str(STEPS), "--model.dropout", "0.1", "--train.micro_batch", "2",
            "--checkpoint.every", str(EVERY), "--checkpoint.keep", "0", "--train.eval_every", "4",
            "--data.cache_dir", cache, "--log.progress", "false", "--log.sample_tokens", "0",
            "--log.plot", "false", *extra]


def env(extra: dict | None = None) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(extra or {})}


def cli(argv: list[str], extra_env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zerotron", *argv], cwd=ROOT, env=env(extra_env),
                          capture_output=True, text=True, timeout=600, check=False)


def start(argv: list[str], extra_env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "zerotron", *argv], cwd=ROOT, env=env(extra_env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def steps_done(run: Path) -> int:
    f = run / "metrics.jsonl"
    if not f.exists():
        return 0
    done = 0
    for ln in f.read_text().splitlines():
        try:
            done = max(done, json.loads(ln)["step"])
        except (ValueError, KeyError):
            pass
    return done


def wait_steps(p: subprocess.Popen, run: Path, n: int, limit_s: float = 300) -> None:
    t0 = time.monotonic()
    while steps_done(run) < n:
        if p.poll() is not None or time.monotonic() - t0 > limit_s:
            raise RuntimeError(f"run ended or stalled before step {n}: {p.communicate()[1][-2000:]}")
        time.sleep(0.05)


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def worker(launcher: int, rank: int) -> int:
    """pid of the worker process with RANK=rank under ``launcher``."""
    todo, seen = [launcher], []
    while todo:
        pid = todo.pop()
        try:
            kids = children(pid)
        except FileNotFoundError:
            continue
        seen += kids
        todo += kids
    for pid in seen:
        try:
            envs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except (FileNotFoundError, PermissionError):
            continue
        if f"RANK={rank}".encode() in envs:
            return pid
    raise RuntimeError(f"no worker with RANK={rank} under pid {launcher}")


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return False


def ours(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("zerotron:")]


def newest_ckpt(run: Path) -> int:
    from zerotron.train.checkpoint import list_checkpoints

    cks = list_checkpoints(run)
    return cks[-1][0] if cks else 0


def losses(run: Path) -> list:
    return [json.loads(ln)["loss"] for ln in (run / "metrics.jsonl").read_text().splitlines()]


def same_state(a: Path, b: Path, tmp: Path) -> bool:
    import torch

    from zerotron.testing import checkpoint_flat

    x = checkpoint_flat(a / "checkpoints" / f"step_{STEPS}", tmp / "a.pt")
    y = checkpoint_flat(b / "checkpoints" / f"step_{STEPS}", tmp / "b.pt")
    return x.keys() == y.keys() and all(
        torch.equal(x[k], y[k]) if isinstance(x[k], torch.Tensor) else x[k] == y[k] for k in x)


def died_after(run: Path, cache: str, step: int) -> None:
    """A run directory as a run of the reference's settings leaves it when it dies right after
    the checkpoint of ``step``: the full run, then later checkpoints and metrics rows removed."""
    import shutil

    from zerotron.train.checkpoint import list_checkpoints

    r = cli(base(run, cache))
    assert r.returncode == 0, r.stderr
    for st, path in list_checkpoints(run):
        if st > step:
            shutil.rmtree(path)
    rows = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("".join(ln + "\n" for ln in rows if json.loads(ln)["step"] <= step))
    (run / "summary.json").unlink(missing_ok=True)


class Case:
    """One row: ``fault`` (what was done), ``sees`` (exit code + zerotron's line), ``lost`` steps,
    ``equal`` (resume to the end equals the reference), ``to_error_s`` (dead/hung rank)."""

    def __init__(self, name: str, fault: str):
        self.row = {"name": name, "fault": fault, "exit": None, "sees": "", "lines": None, "lost_steps": None,
                    "resume_equal": None, "to_error_s": None}

    def saw(self, code: int, stderr: str, want: str = "") -> None:
        lines = ours(stderr)
        pick = next((ln for ln in lines if want and want in ln), lines[-1] if lines else "(no zerotron line)")
        pick = pick[len("zerotron: "):] if pick.startswith("zerotron: ") else pick
        if "resume with: " in pick:  # the command repeats the run's arguments: shorten them
            pick = pick.split("resume with: ")[0] + "resume with: zerotron train ... --resume"
        self.row["exit"], self.row["sees"], self.row["lines"] = code, pick, len(lines)
        if want and want not in pick:  # keep the evidence: the whole stderr beside the table
            self.row["stderr_tail"] = stderr[-4000:]


def in_tmpfs(tmp: Path, name: str, size: str, argv: list[str], during: str = "", extra_env: dict | None = None):
    """Run ``zerotron <argv>`` (its ``--run-dir`` is ``DISK/run``) on a fresh tmpfs of ``size``
    in a user + mount namespace; ``during``: shell run meanwhile ($DISK, $RC, $ERR are set). The
    run directory is copied out to ``tmp/name``. Returns (exit code, stderr, run dir), or None
    where no tmpfs can be mounted."""
    import shlex
    import shutil

    disk, out = tmp / f"{name}_disk", tmp / f"{name}_out"
    disk.mkdir()
    out.mkdir()
    q = shlex.quote
    cmd = shlex.join([sys.executable, "-m", "zerotron", *argv]).replace("DISK/run", f"{disk}/run")
    script = (f"mount -t tmpfs -o size={size} tmpfs {q(str(disk))} || exit 77; DISK={q(str(disk))}; "
              f"ERR={q(str(out / 'err'))}; RC={q(str(out / 'rc'))}; : > $ERR; "
              f"( {cmd} 2> $ERR; echo $? > $RC.tmp; mv $RC.tmp $RC ) & {during or ':'}; wait; "
              f"cp -a {q(str(disk / 'run'))} {q(str(tmp / name))}")
    r = subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=ROOT, env=env(extra_env), capture_output=True,
                       text=True, timeout=600, check=False) if shutil.which("unshare") else None
    if r is None or r.returncode == 77 or not (out / "rc").exists():
        return None
    return int((out / "rc").read_text()), (out / "err").read_text(), tmp / name


FILL = "dd if=/dev/zero of=$DISK/filler bs=64k 2>/dev/null || true"


def resume_and_compare(case: Case, run: Path, ref: Path, cache: str, tmp: Path, reached: int | None = None,
                       extra: tuple = ()) -> None:
    reached = steps_done(run) if reached is None else reached
    case.row["lost_steps"] = reached - newest_ckpt(run)
    r = cli([*base(run, cache, *extra), "--resume"])
    if r.returncode != 0:
        case.row["resume_equal"] = False
        case.row["sees"] += f" | resume failed: {(ours(r.stderr) or [r.stderr[-300:]])[-1]}"
        return
    case.row["resume_equal"] = losses(run) == losses(ref) and same_state(ref, run, tmp)


def run_cases(out: Path, only: set[str] | None) -> list[dict]:
    import shutil

    from zerotron.data import prepare_data
    from zerotron.testing import tiny_config

    tmp = Path(tempfile.mkdtemp(prefix="zerotron_faults_"))
    cache = str(tmp / "cache")
    d = tiny_config({"data.cache_dir": cache}).data
    prepare_data(d.corpus, None, d.text_field, d.vocab_size, d.val_fraction, d.cache_dir)
    ref = tmp / "ref"
    r = cli(base(ref, cache))
    assert r.returncode == 0, r.stderr
    slow = {"ZEROTRON_FAULT_STEP_SLEEP_S": "0.4"}
    rows = []

    def want(name):
        return only is None or name in only

    for name, sig, group in [("sigterm", signal.SIGTERM, False), ("sigint-group", signal.SIGINT, True),
                             ("sighup", signal.SIGHUP, False)]:
        if not want(name):
            continue
        c, run = Case(name, f"{sig.name} to the {'process group' if group else 'launcher'} after step 4"), tmp / name
        p = start(base(run, cache), slow)
        wait_steps(p, run, 4)
        t0 = time.monotonic()
        (os.killpg if group else os.kill)(p.pid, sig)
        _, err = p.communicate(timeout=300)
        c.row["to_error_s"] = round(time.monotonic() - t0, 1)
        c.saw(p.returncode, err, "stopped by")
        resume_and_compare(c, run, ref, cache, tmp)
        rows.append(c.row)

    if want("second-signal"):
        c, run = Case("second-signal", "SIGTERM, then a second SIGTERM at once (impatient user)"), tmp / "second"
        p = start(base(run, cache), {"ZEROTRON_FAULT_STEP_SLEEP_S": "2"})
        wait_steps(p, run, 2)
        os.kill(p.pid, signal.SIGTERM)
        time.sleep(0.2)
        t0 = time.monotonic()
        os.kill(p.pid, signal.SIGTERM)
        _, err = p.communicate(timeout=300)
        c.row["to_error_s"] = round(time.monotonic() - t0, 1)
        c.saw(p.returncode, err)
        resume_and_compare(c, run, ref, cache, tmp)
        rows.append(c.row)

    for name, restarts in [("kill9-worker", 0), ("kill9-worker-restart", 1)]:
        if not want(name):
            continue
        c, run = Case(name, "kill -9 of rank 1 after step 5" + (" with --max-restarts 1" if restarts else "")), \
            tmp / name
        extra = ("--max-restarts", "1") if restarts else ()
        p = start(base(run, cache, *extra), {"ZEROTRON_FAULT_STEP_SLEEP_S": "0.3"})
        wait_steps(p, run, 5)
        reached = steps_done(run)
        t0 = time.monotonic()
        os.kill(worker(p.pid, 1), signal.SIGKILL)
        if restarts:
            _, err = p.communicate(timeout=300)
            c.saw(p.returncode, err, "restart 1 of 1")
            m = re.search(r"restart 1 of 1: the workers resume from step (\d+)", err)
            c.row["lost_steps"] = reached - int(m.group(1)) if m else None
            c.row["resume_equal"] = p.returncode == 0 and losses(run)[-STEPS:] == losses(ref) \
                and same_state(ref, run, tmp)
        else:
            _, err = p.communicate(timeout=300)
            c.row["to_error_s"] = round(time.monotonic() - t0, 1)
            c.saw(p.returncode, err, "failed")
            resume_and_compare(c, run, ref, cache, tmp, reached)
        rows.append(c.row)

    if want("kill9-launcher"):
        c, run = Case("kill9-launcher", "kill -9 of the launcher after step 5"), tmp / "kill9-launcher"
        p = start(base(run, cache), {"ZEROTRON_FAULT_STEP_SLEEP_S": "0.3"})
        wait_steps(p, run, 5)
        ws = [worker(p.pid, r) for r in (0, 1)]
        reached = steps_done(run)
        t0 = time.monotonic()
        os.kill(p.pid, signal.SIGKILL)
        p.communicate(timeout=60)
        while any(alive(w) for w in ws) and time.monotonic() - t0 < 60:
            time.sleep(0.05)
        c.row["to_error_s"] = round(time.monotonic() - t0, 1)
        c.row["exit"], c.row["sees"] = p.returncode, ("workers exited with the launcher (SIGTERM by "
                                                      "PR_SET_PDEATHSIG: they finished the step and saved)" if not any(
            alive(w) for w in ws) else "workers still running after 60 s")
        resume_and_compare(c, run, ref, cache, tmp, max(reached, steps_done(run)))
        rows.append(c.row)

    if want("sigstop-worker"):
        c, run = Case("sigstop-worker", "SIGSTOP of rank 1 after step 5 (hung rank), parallel.timeout_s 10"), \
            tmp / "sigstop"
        p = start(base(run, cache, "--parallel.timeout_s", "10"), {"ZEROTRON_FAULT_STEP_SLEEP_S": "0.3"})
        wait_steps(p, run, 5)
        victim = worker(p.pid, 1)
        reached = steps_done(run)
        os.kill(victim, signal.SIGSTOP)
        t0, lines = time.monotonic(), []
        for line in p.stderr:
            lines.append(line)
            if "got no answer" in line:
                c.row["to_error_s"] = round(time.monotonic() - t0, 1)
                break
        time.sleep(1)
        if alive(victim):
            os.kill(victim, signal.SIGCONT)
        rest, _ = p.stderr.read(), p.wait(timeout=120)
        c.saw(p.returncode, "".join(lines) + rest, "got no answer")
        resume_and_compare(c, run, ref, cache, tmp, reached)
        rows.append(c.row)

    if want("disk-full"):
        c, run = Case("disk-full", "ENOSPC while rank 1 writes the checkpoint of step 6 (injected)"), tmp / "disk"
        r = cli(base(run, cache, "--checkpoint.on_error", "stop"), {"ZEROTRON_FAULT_SAVE_ENOSPC_AT_STEP": "6",
                                                                     "ZEROTRON_FAULT_SAVE_RANK": "1"})
        c.saw(r.returncode, r.stderr, "cannot write")
        partial = list((run / "checkpoints").glob(".tmp_step_*"))
        c.row["sees"] += f" [partial dirs left: {len(partial)}]"
        resume_and_compare(c, run, ref, cache, tmp)
        rows.append(c.row)

    if want("corrupt-checkpoint"):
        c, run = Case("corrupt-checkpoint", "1 KiB garbled inside a tensor file of the newest checkpoint "
                      "(same size), then --resume"), tmp / "corrupt"
        died_after(run, cache, 6)
        f = run / "checkpoints" / "step_6" / "__0_0.distcp"
        with open(f, "r+b") as fh:
            fh.seek(f.stat().st_size // 2)
            fh.write(os.urandom(1024))
        reached = steps_done(run)
        r = cli([*base(run, cache), "--resume"])
        c.saw(r.returncode, r.stderr, "damaged")
        c.row["lost_steps"] = reached - EVERY  # falls back to step_3
        c.row["resume_equal"] = r.returncode == 0 and losses(run) == losses(ref) and same_state(ref, run, tmp)
        c.row["sees"] += f" [kept as: {', '.join(sorted(p.name for p in (run / 'checkpoints').iterdir()))}]"
        rows.append(c.row)

    if want("torn-metrics"):
        c, run = Case("torn-metrics", "torn last line of metrics.jsonl and a stale .tmp_step_* (disk filled "
                      "mid-write), then --resume"), tmp / "torn"
        died_after(run, cache, 6)
        with open(run / "metrics.jsonl", "a") as fh:
            fh.write('{"step": 7, "loss": 3.1')
        (run / "checkpoints" / ".tmp_step_7").mkdir()
        c.row["lost_steps"] = 0
        r = cli([*base(run, cache), "--resume"])
        c.saw(r.returncode, r.stderr, "torn")
        c.row["resume_equal"] = r.returncode == 0 and losses(run) == losses(ref) and same_state(ref, run, tmp)
        rows.append(c.row)

    if want("two-runs"):
        c, run = Case("two-runs", "a second `train` on the same --run-dir while the first runs"), tmp / "two"
        p = start(base(run, cache), slow)
        wait_steps(p, run, 2)
        r = cli(base(run, cache))
        c.saw(r.returncode, r.stderr)
        _, err = p.communicate(timeout=300)
        c.row["lost_steps"] = 0
        c.row["resume_equal"] = p.returncode == 0 and losses(run) == losses(ref) and same_state(ref, run, tmp)
        rows.append(c.row)

    if want("resume-other-model"):
        c, run = Case("resume-other-model", "--resume with --model.bias false on a checkpoint with biases"), \
            tmp / "bias"
        died_after(run, cache, 6)
        before = sorted(str(p) for p in run.rglob("*"))
        r = cli([*base(run, cache, "--model.bias", "false"), "--resume"])
        c.saw(r.returncode, r.stderr)
        c.row["sees"] += " [run dir unchanged]" if sorted(str(p) for p in run.rglob("*")) == before else \
            " [run dir CHANGED]"
        resume_and_compare(c, run, ref, cache, tmp)
        rows.append(c.row)

    if want("nan-one-rank"):
        c, run = Case("nan-one-rank", "a NaN gradient on rank 1 at step 3 (injected)"), tmp / "nan"
        r = cli(base(run, cache), {"ZEROTRON_FAULT_NAN_AT_STEPS": "3", "ZEROTRON_FAULT_NAN_RANK": "1"})
        c.saw(r.returncode, r.stderr, "was skipped")
        c.row["lost_steps"] = 0
        c.row["resume_equal"] = "n/a (the step's update is skipped on every rank)"
        rows.append(c.row)

    if want("diverging"):
        c, run = Case("diverging", "--train.lr 50 (the loss diverges to inf/NaN)"), tmp / "div"
        r = cli(base(run, cache, "--train.lr", "50", "--train.warmup_steps", "1", "--train.steps", "40",
                     "--checkpoint.every", "2"))
        c.saw(r.returncode, r.stderr, "stop")
        from zerotron.train.checkpoint import verify_checkpoint
        good = newest_ckpt(run)
        if good:
            verify_checkpoint(run / "checkpoints" / f"step_{good}")
        c.row["lost_steps"] = steps_done(run) - good
        c.row["resume_equal"] = "n/a (newest checkpoint finite: step %d)" % good
        rows.append(c.row)

    if want("init-from-unsupported") or want("init-from-tp-kv-heads"):
        from zerotron.models.hf_llama import export_hf_llama
        from zerotron.models.llama import Llama, LlamaConfig

        hf = export_hf_llama(Llama(LlamaConfig(vocab_size=512, block_size=64, n_layer=2, n_head=4, n_kv_head=1,
                                               n_embd=64, intermediate_size=128).validate()), None, tmp / "hf")
        rope = tmp / "hf_rope"
        shutil.copytree(hf, rope)
        conf = json.loads((rope / "config.json").read_text())
        conf["rope_scaling"] = conf["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}
        (rope / "config.json").write_text(json.dumps(conf))
        for name, src, extra, fault in [
                ("init-from-unsupported", rope, (), "--model.init_from a HF Llama with rope_scaling linear"),
                ("init-from-tp-kv-heads", hf, ("--parallel.tp", "2"),
                 "--model.init_from a HF Llama with 1 kv head, --parallel.tp 2")]:
            if not want(name):
                continue
            c, run = Case(name, fault + " (--nproc 2)"), tmp / name
            r = cli([*base(run, cache, "--model.init_from", str(src), *extra)])
            c.saw(r.returncode, r.stderr, "init_from")
            c.row["sees"] += " [run dir left: " + ("yes" if run.exists() else "no") + "]"
            c.row["lost_steps"], c.row["resume_equal"] = 0, "n/a (refused before any worker)"
            rows.append(c.row)

    if want("meta-step-edited"):
        c, run = Case("meta-step-edited", '"step": 6 changed to 7 in step_6/meta.json, then --resume'), tmp / "meta"
        died_after(run, cache, 6)
        f = run / "checkpoints" / "step_6" / "meta.json"
        f.write_text(f.read_text().replace('"step": 6,', '"step": 7,', 1))
        reached = steps_done(run)
        r = cli([*base(run, cache), "--resume"])
        c.saw(r.returncode, r.stderr, "damaged")
        c.row["lost_steps"] = reached - EVERY  # falls back to step_3
        c.row["resume_equal"] = r.returncode == 0 and losses(run) == losses(ref) and same_state(ref, run, tmp)
        c.row["sees"] += f" [kept as: {', '.join(sorted(p.name for p in (run / 'checkpoints').iterdir()))}]"
        rows.append(c.row)

    if want("metrics-disk-full"):  # (checkpoint.on_error = stop: tests/test_faults.py, on a resumed run)
        c = Case("metrics-disk-full", "20 MiB tmpfs filled with dd after step_3 exists, never freed: metrics.jsonl "
                 "appends, the saves of steps 6 and 8 and summary.json meet the full disk")
        got = in_tmpfs(tmp, "metrics", "20M", base(Path("DISK/run"), cache),
                       during="while [ ! -e $DISK/run/checkpoints/step_3 ] && [ ! -e \"$RC\" ]; do sleep 0.05; "
                              f"done; {FILL}", extra_env={"ZEROTRON_FAULT_STEP_SLEEP_S": "0.3"})
        if got is None:
            c.row["sees"] = "skipped: no tmpfs can be mounted here (unshare -rm)"
        else:
            code, err, run = got
            c.saw(code, err, "stopped")
            text = (run / "metrics.jsonl").read_text()
            whole = text.endswith("\n") and all(json.loads(ln) for ln in text.splitlines())
            c.row["sees"] += f" [metrics.jsonl: whole lines {'yes' if whole else 'NO'}, steps 1-{steps_done(run)}; " \
                             f"summary.json {'written' if (run / 'summary.json').exists() else 'not written'}]"
            m = re.findall(r"step_(\d+)", c.row["sees"])
            resume_and_compare(c, run, ref, cache, tmp, int(m[0]) if m else None)
        rows.append(c.row)

    if want("final-save-no-space"):
        c = Case("final-save-no-space", "5 MiB tmpfs: step_3 (3.4 MB) fits, then 1.6 MB free for steps 6 and 8")
        got = in_tmpfs(tmp, "final", "5M", base(Path("DISK/run"), cache, "--checkpoint.keep", "1"))
        if got is None:
            c.row["sees"] = "skipped: no tmpfs can be mounted here (unshare -rm)"
        else:
            code, err, run = got
            c.saw(code, err, "stopped")
            summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else None
            c.row["sees"] += (f" [summary.json: failed_checkpoints {summary['failed_checkpoints']}, exit_code "
                              f"{summary.get('exit_code')}]" if summary else " [summary.json: MISSING]")
            resume_and_compare(c, run, ref, cache, tmp)
        rows.append(c.row)

    shutil.rmtree(tmp, ignore_errors=True)
    return rows


def markdown(rows: list[dict]) -> str:
    head = ("| fault | exit | what the user sees | lines | lost steps | resume equal | time to stop (s) |\n"
            "|---|---|---|---|---|---|---|\n")
    cell = lambda v: "—" if v is None else ("yes" if v is True else ("**no**" if v is False else str(v)))  # noqa: E731
    return head + "".join(
        f"| {r['fault']} | {cell(r['exit'])} | {r['sees'].replace('|', '/')} | {cell(r.get('lines'))} | "
        f"{cell(r['lost_steps'])} | "
        f"{cell(r['resume_equal'])} | {cell(r['to_error_s'])} |\n" for r in rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "faults_cpu"), help="writes OUT.json and OUT.md")
    ap.add_argument("--only", default="", help="comma-separated case names (default: all)")
    a = ap.parse_args()
    t0 = time.monotonic()
    rows = run_cases(Path(a.out), set(a.only.split(",")) if a.only else None)
    for r in rows:  # the temporary directory's name changes every run: write RUN for a run directory
        r["sees"] = re.sub(r"/\S*/zerotron_faults_[^/]+/[^/\s']+", "RUN", r["sees"])
    if a.only and Path(a.out + ".json").exists():  # --only: replace those rows, keep the others
        new = {r["name"]: r for r in rows}
        old_rows = json.loads(Path(a.out + ".json").read_text())
        rows = [new.pop(r["name"], r) for r in old_rows] + list(new.values())
    Path(a.out + ".json").write_text(json.dumps(rows, indent=1) + "\n")
    md = (f"# Faults: what the user sees, what is lost, whether resume is equal\n\n"
          f"`python benchmarks/faults_table.py` ({'rows of several runs, merged by --only' if a.only else f'{time.monotonic() - t0:.0f} s'}): 2 processes, configs/tiny.toml, "
          f"{STEPS} steps, a checkpoint every {EVERY}, dropout 0.1; \"resume equal\" = per-step losses and the final "
          "model + optimizer state bitwise equal to an uninterrupted run.\n\n" + markdown(rows))
    Path(a.out + ".md").write_text(md)
    print(md)
    return 0 if all(r["resume_equal"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
