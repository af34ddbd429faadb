"""Bad inputs through the CLI: one clear message each, exit code 2, nothing on disk touched."""
import json
import os
from pathlib import Path

import pytest

from zerotron.cli import main

TINY = "configs/tiny.toml"


def run(argv, capsys):
    code = main(argv)
    err = capsys.readouterr().err
    return code, err


CASES = [
    (["train", "--config", TINY, "--train.stepz", "3"], "unknown config key train.stepz (did you mean 'steps'?)"),
    (["train", "--config", TINY, "--train.steps", "abc"], "train.steps must be int, got 'abc'"),
    # a float for an int setting (was int(1e20): a 10**20-step run accepted), and 64-bit / seed bounds
    (["train", "--config", TINY, "--train.steps", "1e20"],
     "train.steps must be int, got '1e20' (an integer in digits, e.g. --train.steps 100)"),
    (["train", "--config", TINY, "--train.micro_batch", "2.0"], "train.micro_batch must be int, got '2.0'"),
    (["train", "--config", TINY, "--train.steps", str(10**20)],
     "train.steps must fit in 64 bits (|value| < 2**63), got 100000000000000000000"),
    (["train", "--config", TINY, "--train.seed", "-1"], "train.seed must be in [0, 2**63), got -1"),
    # more GPUs than any split of the model and batch can use: was "no layout fits: add GPUs or memory"
    (["plan", "--model", "gpt2", "--gpus", "100000", "--global-batch", "256", "--seq", "1024"],
     "no split of 100,000 GPUs as dp x tp x pp x cp fits this model and batch: dp must divide the global batch (256)"),
    # extra words after --version / --help were ignored (the version printed, exit 0)
    (["--version", "extra"], "--version prints the version and takes no arguments, got 'extra'"),
    (["help", "train", "now"], "help prints the usage and takes no arguments, got 'train now'"),
    (["train", "--config", "nope.toml"], "config file 'nope.toml' not found"),
    (["train", "--config", "configs"], "config file 'configs' is a directory; pass an existing TOML file"),  # was "not found"
    (["train", "--config", TINY, "--train.global_batch", "10", "--train.micro_batch", "4"],
     "train.global_batch (10) must be divisible by train.micro_batch * dp"),
    (["train", "--config", TINY, "--model.n_embd", "66"], "model.n_embd (66) must be divisible by model.n_head (4)"),
    (["train", "--config", TINY, "--parallel.dp", "3"], "does not equal the world size 1"),
    (["train", "--config", TINY, "--model.preset", "gpt5"], "model.preset 'gpt5' is unknown"),
    # an explicit 0 silently meant the preset's or the default size (4 layers)
    (["train", "--config", TINY, "--model.n_layer", "0"], "model.n_layer = 0 is not a size: set it >= 1, or leave it "
     "out of the config and flags to take the default"),
    (["train", "--config", "configs/llama_tiny.toml", "--model.n_kv_head", "0"],
     "model.n_kv_head = 0 is not a size: set it >= 1, or leave it out of the config and flags to take the value of "
     "preset 'llama-tiny'"),
    (["train", "--config", TINY, "--data.corpus", "files"], "data.corpus = 'files' needs data.path"),
    (["train", "--config", TINY, "--data.corpus", "files", "--data.path", "/no/such/file.txt"], "/no/such/file.txt"),
    (["train", "--config", TINY, "--train.dtype", "fp8"], "train.dtype must be one of ('fp32', 'bf16', 'fp64'), got 'fp8'"),
    (["train", "--config", TINY, "--train.lr", "-1"], "train.lr must be > 0"),
    # refused before the run: a negative sample length failed after the last step (traceback, no summary.json)
    (["train", "--config", TINY, "--log.sample_tokens", "-3"], "log.sample_tokens must be in [0, 100,000] (0 = no sample"),
    # no cap (as generate's --max-new-tokens): the sample after the last step decoded for ever
    (["train", "--config", TINY, "--log.sample_tokens", str(10**9)],
     "log.sample_tokens must be in [0, 100,000] (0 = no sample at the end; past the model's context"),
    (["train", "--config", TINY, "--log.every", "0"], "log.every must be >= 1"),
    # a folder that cannot be made: was a bare "[Errno 2] No such file or directory"
    (["train", "--config", TINY, "--data.cache_dir", "/proc/nope/cache"],
     "data.cache_dir '/proc/nope/cache' cannot be created (No such file or directory): give a writable folder"),
    (["train", "--config", TINY, "--model.dropout", "1.5"], "model.dropout must be in [0, 1)"),
    # a LoRA rank above a targeted layer's min(in, out) (was accepted: adapters larger than the model)
    (["train", "--config", TINY, "--train.lora_rank", "100000"], "train.lora_rank (100000) exceeds the rank a LoRA "
     "update of attn.c_attn can have, min(in, out) = min(64, 192) = 64: choose train.lora_rank <= 64"),
    (["train", "--config", "configs/llama_tiny.toml", "--train.lora_rank", "33", "--train.lora_targets", "q_proj,v_proj"],
     "of self_attn.v_proj can have, min(in, out) = min(64, 32) = 32"),
    (["train", "--config", TINY, "--bogus.key", "1"], "unknown config section 'bogus'"),
    (["train", "--config", TINY, "--train.steps"], "override --train.steps needs a value"),
    (["train", "--config", TINY, "stray"], "unexpected argument 'stray'"),
    (["bench", "plan", "--bench-train", "/no/a.json", "--bench-comm", "/no/b.json"],
     "cannot read '/no/a.json' (No such file or directory); pass the files"),
    (["train", "--config", TINY, "--parallel.dp_impl", "mpi"], "parallel.dp_impl must be one of"),
    (["generate", "--checkpoint", "/no/such/run", "--prompt", "hi"], "no checkpoint found at '/no/such/run'"),
    (["frobnicate"], "unknown command 'frobnicate'"),
    (["trian"], "unknown command 'trian' (did you mean 'train'?)"),
    (["generate", "--checkpoint", "/no/such/run", "--prompt", "hi", "--temperature", "-1"],
     "--temperature must be a finite number >= 0 (0 = greedy), got -1.0"),
    (["generate", "--checkpoint", "/no/such/run", "--prompt", "hi", "--top-k", "0"], "--top-k must be >= 1"),
    # torch's generator took it as "Overflow when unpacking long long" (one line, naming nothing)
    (["generate", "--checkpoint", "/no/such/run", "--prompt", "hi", "--seed", str(10**30)],
     "--seed must be in [0, 2**63), got 1000000000000000000000000000000"),
    # no cap: a mistyped 10**12 decoded for ever (past the context each token recomputes the window)
    (["generate", "--checkpoint", "/no/such/run", "--prompt", "hi", "--max-new-tokens", str(10**12)],
     "--max-new-tokens 1000000000000 is more than 100,000, the most one prompt may ask for"),
    (["generate", "--checkpoint", "/no/such/run", "--prompts-file", "/no/p.txt", "--nproc", "2",
      "--max-new-tokens", "100001"], "--max-new-tokens 100001 is more than 100,000"),
    (["bench", "nothing"], "usage: zerotron bench comm|train|plan"),
    (["bench", "plan", "--bench-train", "/no/such.json", "--bench-comm", "/no/such.json"], "/no/such.json"),
    # a torn result file (was only "Expecting value: line 1 column 1 (char 0)", naming neither file nor flag)
    (["bench", "plan", "--bench-train", "README.md", "--bench-comm", "README.md"],
     "--bench-train 'README.md' is not valid JSON (Expecting value: line 1 column 1 (char 0)); pass a file "
     "'zerotron bench train --json' wrote"),
    (["memory", "--params", "1e6", "--dp", "0"], "dp"),
    # without --seq the sequence is the preset's block_size (1024): cp 3 was estimated though training refuses it
    (["memory", "--model", "gpt2", "--dp", "2", "--cp", "3"], "--cp 3 needs the sequence, gpt2's block_size 1024"),
    (["serve", "--checkpoint", "/no/such/run"], "no checkpoint found at '/no/such/run'"),
    (["serve", "--checkpoint", "/no/such/run", "--port", "99999"], "--port must be in 0..65535"),
    (["serve", "--checkpoint", "/no/such/run", "--nproc", "3", "--parallel.pp", "2"], "multiple of"),
    (["serve", "--checkpoint", "/no/such/run", "--parallel.tp", "2"], "world size 1 is not divisible by tp*pp"),
    (["bench", "generate", "--layouts", "foo"], "unknown layout(s) foo"),
    (["bench", "generate", "--prompts", "0"], "--prompts"),
    (["serve", "--checkpoint", "/no/such/run", "--batching", "paged"], "--batching must be one of continuous, window"),
    (["serve", "--checkpoint", "/no/such/run", "--microbatches", "2"], "--microbatches 2 needs --batching window"),
    (["bench", "serve", "--max-tokens", "0"], "--max-tokens must be a comma list"),
    (["bench", "serve", "--rounds", "0"], "--rounds"),
    (["generate", "--checkpoint", "/no/such/run", "--prompt", "hi", "--top-p", "0"], "--top-p"),
    # a run directory that cannot be made (a file in the way; /proc: read-only even for root): one line
    # naming it, not a bare '[Errno 17] File exists' or a PermissionError traceback (/sys)
    (["train", "--config", TINY, "--run-dir", "pyproject.toml/run"], "run directory 'pyproject.toml/run' cannot be "
     "written (Not a directory); give a --run-dir in a folder you can write"),
    (["train", "--config", TINY, "--run-dir", "pyproject.toml"], "run directory 'pyproject.toml' is a file"),
    (["train", "--config", TINY, "--run-dir", "/proc/zerotron-run"], "run directory '/proc/zerotron-run' cannot be written"),
    # a negative --nproc was taken as "this process alone" by generate and serve (train refuses it)
    (["generate", "--checkpoint", "/no/such/run", "--prompt", "hi", "--nproc", "-3"], "--nproc must be >= 0"),
    (["serve", "--checkpoint", "/no/such/run", "--nproc", "-2"], "--nproc must be >= 0"),
    # schedule's PNG: one line naming the path (was "[Errno 2] No such file or directory: '/proc/x.png'")
    (["schedule", "--pp", "2", "--microbatches", "2", "--kind", "1f1b", "--out", "/proc/x.png"],
     "--out /proc/x.png: cannot write there"),
    # export's --out is checked before the checkpoint is read: a folder that cannot be written (/proc,
    # even for root) or a path through a file (were "No such file or directory (0 bytes free on
    # '/proc')... free some space" after loading, and a bare "[Errno 17] File exists")
    (["export", "--checkpoint", "/no/such/run", "--out", "/proc/x"],
     "--out '/proc/x': cannot write in '/proc' (No such file or directory); choose an --out directory in a folder"),
    (["export", "--checkpoint", "/no/such/run", "--out", "pyproject.toml/sub"],
     "pyproject.toml' is a file, not a directory; choose another --out directory"),
    # every bench command checks its result files before it runs (was: a traceback after the whole
    # run); each line also has a second bad argument that, checked first, would give another message
    (["bench", "train", "--json", "/proc/t.json", "--config", "/no/such.toml"], "--json /proc/t.json: cannot write there"),
    (["bench", "train", "--plot", "pyproject.toml/p.png", "--config", "/no/such.toml"],
     "pyproject.toml is a file, not a directory; pass a file path in a writable directory"),
    (["bench", "context", "--json", "/proc/c.json", "--seq", "x"], "--json /proc/c.json: cannot write there"),
    (["bench", "comm", "--plot", "/proc/c.png", "--ops", "bogus"], "--plot /proc/c.png: cannot write there"),
    (["bench", "generate", "--markdown", "/proc/g.md", "--layouts", "foo"], "--markdown /proc/g.md: cannot write there"),
    (["bench", "generate", "--json", "configs", "--layouts", "foo"], "--json configs: is a directory"),
    (["bench", "serve", "--json", "/proc/s.json", "--max-tokens", "0"], "--json /proc/s.json: cannot write there"),
    (["bench", "serve", "--checkpoint", "x", "--markdown", "/proc/s.md", "--concurrency", "0"],
     "--markdown /proc/s.md: cannot write there"),
    (["bench", "paged", "--json", "/proc/p.json", "--rounds", "0"], "--json /proc/p.json: cannot write there"),
    (["bench", "plan", "--bench-train", "/no/a.json", "--bench-comm", "/no/b.json", "--out", "/proc/r.md"],
     "--out /proc/r.md: cannot write there"),
    # a value that starts like a negative number is the option's value, checked by the option (argparse
    # took "-5GB" for an option: "argument --gpu-mem: expected one argument")
    (["dryrun", "--world", "2", "--gpu-mem", "-5GB"], "bad memory size '-5GB': use e.g. 80GB"),
    # nodes of 3 ranks under a world of 16 (was traced, with groups placed on a partial last node; plan refuses it)
    (["dryrun", "--config", TINY, "--world", "16", "--gpus-per-node", "3", "--parallel.tp", "2",
      "--train.micro_batch", "1"],
     "--world (16) must be a multiple of --gpus-per-node (3)"),
    (["plan", "--model", "gpt2", "--gpus", "8", "--global-batch", "8", "--gpu-mem", "-80GB"], "bad memory size '-80GB'"),
]


@pytest.mark.parametrize("argv,message", CASES, ids=[c[1][:40] for c in CASES])
def test_bad_input(argv, message, capsys):
    code, err = run(argv, capsys)
    assert code == 2
    assert message in err, err


USAGE_ERRORS = [
    (["generate", "--checkpoint", "x", "--prompt", "hi", "--max-new-tokens", "abc"],
     "argument --max-new-tokens: invalid int value: 'abc'"),
    (["generate", "--checkpoint", "x"], "one of the arguments --prompt --prompts-file is required"),
    (["generate", "--bogus"], "unrecognized arguments: --bogus"),  # named before the missing --checkpoint
    (["generate", "--checkpoint", "x", "--promt", "hi"], "unrecognized arguments: --promt (did you mean --prompt?)"),
    (["export", "--out", "o", "--checkpoin=x", "--bogus=1"], "unrecognized arguments: --bogus=1"),
    (["memory", "--model", "gpt2", "--dp", "x"], "argument --dp: invalid int value: 'x'"),
    (["memory", "--model", "gpt2", "--dp", "8", "--bogus"], "unrecognized arguments: --bogus"),
    (["schedule", "--pp", "2", "--microbatches", "4", "--kind", "zigzag"], "argument --kind: invalid choice: 'zigzag'"),
    (["schedule", "--pp", "2", "--kind", "1f1b"], "the following arguments are required: --microbatches"),
    (["train", "--nproc", "x"], "argument --nproc: invalid int value: 'x'"),
    (["export", "--checkpoint", "x"], "the following arguments are required: --out"),
    (["plan", "--model", "gpt2", "--gpus", "x"], "argument --gpus: invalid int value: 'x'"),
    (["bench", "comm", "--iters", "x"], "argument --iters: invalid int value: 'x'"),
    (["bench", "train", "--rounds", "x"], "argument --rounds: invalid int value: 'x'"),
    (["bench", "generate", "--prompts", "x"], "argument --prompts: invalid int value: 'x'"),
    (["bench", "plan", "--bench-train", "a.json"], "the following arguments are required: --bench-comm"),
    (["bench", "checkpoint", "--rounds", "x"], "argument --rounds: invalid int value: 'x'"),
    (["bench", "serve", "--rounds", "x"], "argument --rounds: invalid int value: 'x'"),
    (["serve", "--checkpoint", "x", "--port", "x"], "argument --port: invalid int value: 'x'"),
]


@pytest.mark.parametrize("argv,message", USAGE_ERRORS, ids=[" ".join(c[0][:2]) + ": " + c[1][:30] for c in USAGE_ERRORS])
def test_usage_error_is_one_line(argv, message, capsys):
    """A flag argparse rejects (wrong type, unknown, missing): one line naming it and the --help to
    read, exit 2, no usage block (as the commands' own value checks)."""
    try:
        code = main(argv)
    except SystemExit as e:  # generate, export and train let the parser's SystemExit(2) through
        code = e.code
    out, err = capsys.readouterr()
    prog = "zerotron " + " ".join(argv[:2] if argv[0] == "bench" else argv[:1])
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "usage:" not in err, err
    assert err.startswith(f"{prog}: error: {message}") and err.endswith(f"; run '{prog} --help' for the options\n"), err


def test_bad_toml(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nsteps = = 3\n")
    code, err = run(["train", "--config", str(bad)], capsys)
    assert code == 2 and "is not valid TOML" in err
    bad.write_text("[train]\nsteps = 'ten'\n")
    code, err = run(["train", "--config", str(bad)], capsys)
    assert code == 2 and "train.steps must be int, got str 'ten'" in err
    bad.write_text("[train]\nsteps = 1e20\n")  # a float for an int setting: refused, as on the command line
    code, err = run(["train", "--config", str(bad)], capsys)
    assert code == 2 and "train.steps must be int, got float 1e+20 (an integer in digits, e.g. steps = 100)" in err, err
    bad.write_bytes(b"\xff\xfe[train]\n")  # not UTF-8 (a UTF-16 BOM): one line, not a UnicodeDecodeError traceback
    code, err = run(["train", "--config", str(bad)], capsys)
    assert code == 2 and "is not UTF-8 text (byte 0)" in err and len(err.strip().splitlines()) == 1, err


def test_existing_run_dir_untouched(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in run_dir.rglob("*")}
    # a run killed before its first checkpoint: neither a fresh start nor --resume can take it, and both
    # say so (they sent the user in a circle: "pass --resume" / "start without --resume")
    for extra in ([], ["--resume"]):
        code, err = run(["train", "--config", TINY, "--run-dir", str(run_dir), *extra], capsys)
        assert code == 2 and "already holds a run without a checkpoint (only metrics.jsonl), so there is " \
            "nothing to resume; choose a new --run-dir" in err, err
        assert {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in run_dir.rglob("*")} == before
    (run_dir / "checkpoints" / "step_1").mkdir(parents=True)
    code, err = run(["train", "--config", TINY, "--run-dir", str(run_dir)], capsys)
    assert code == 2 and "already holds a run; pass --resume" in err


def test_checkpoints_file_is_named_and_untouched(tmp_path, capsys):
    """``<run>/checkpoints`` a file: train said "a run without a checkpoint (only metrics.jsonl) ...
    delete the run directory" (a finished run's data), a fresh run trained to its first save and
    failed with "free disk space", generate and serve "no checkpoint found"."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    (run_dir / "checkpoints").write_text("not a folder")
    fresh = tmp_path / "fresh"  # a directory with nothing but the file in the way
    fresh.mkdir()
    (fresh / "checkpoints").write_text("")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    for argv in (["train", "--config", TINY, "--run-dir", str(run_dir)],
                 ["train", "--config", TINY, "--run-dir", str(run_dir), "--resume"],
                 ["train", "--config", TINY, "--run-dir", str(fresh)],
                 ["generate", "--checkpoint", str(run_dir), "--prompt", "hi"], ["serve", "--checkpoint", str(run_dir)]):
        code, err = run(argv, capsys)
        where = str(fresh if str(fresh) in argv else run_dir)
        assert code == 2 and len(err.strip().splitlines()) == 1, (argv, err)
        assert f"'{where}/checkpoints' is a file, not a folder" in err and "move or rename it" in err, (argv, err)
        assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before, argv


def test_resume_without_checkpoint(tmp_path, capsys):
    code, err = run(["train", "--config", TINY, "--run-dir", str(tmp_path / "empty"), "--resume"], capsys)
    assert code == 2 and "--resume: no checkpoint under" in err
    assert not (tmp_path / "empty").exists()


def test_generate_bad_checkpoint_dir(tmp_path, capsys):
    d = tmp_path / "checkpoints" / "step_3"
    d.mkdir(parents=True)
    (d / "meta.json").write_text(json.dumps({"step": 3, "model_config": {"vocab_size": 10}}))
    code, err = run(["generate", "--checkpoint", str(d), "--prompt", "x"], capsys)
    assert code == 2 and "no .metadata" in err  # verify_checkpoint runs before the load


def test_help(capsys):
    assert main(["--help"]) == 0
    assert "commands:" in capsys.readouterr().out
    assert os.path.exists(TINY)


@pytest.fixture(scope="module")
def small_run(tmp_path_factory, data_cache):
    run = tmp_path_factory.mktemp("small") / "run"
    argv = ["train", "--config", TINY, "--run-dir", str(run), "--train.steps", "2", "--log.progress", "false",
            "--log.sample_tokens", "0", "--log.plot", "false", "--data.cache_dir", data_cache,
            "--checkpoint.every", "1"]
    assert main(argv) == 0
    return run, argv


def test_resume_checks(small_run, tmp_path, capsys):
    import shutil

    run, argv = small_run
    capsys.readouterr()
    # a different model shape is refused before anything runs
    code, err = main([*argv, "--resume", "--model.n_layer", "2"]), capsys.readouterr().err
    assert code == 2 and "model shape differs from the checkpoint" in err and "n_layer 4 (checkpoint) vs 2" in err, err
    # other training data (which tokens train and validate) is refused the same way
    code, err = main([*argv, "--resume", "--train.steps", "3", "--data.val_fraction", "0.2"]), capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "the training data differs from that of the checkpoint" in err and "data.val_fraction 0.05 (checkpoint) vs 0.2" in err, err
    # resuming a finished run (train.steps at or below the step reached) is refused in one line,
    # exit 2, and changes nothing on disk (the lock file is empty again, as the first run left it)
    def snapshot():
        return {str(f.relative_to(run)): f.read_bytes() for f in sorted(run.rglob("*")) if f.is_file()}
    before = snapshot()
    for steps in ("2", "1"):
        code = main([*argv, "--resume", "--train.steps", steps])
        out, err = capsys.readouterr()
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, (out, err)
        assert err.startswith(f"zerotron: error: --resume: nothing to train: the run already reached step 2 "
                              f"({run / 'checkpoints' / 'step_2'}) and train.steps = {steps}; raise train.steps "
                              "above 2 to continue it"), err
        assert snapshot() == before
    # another data.vocab_size: the checkpoint's tokenizer is kept and the new value ignored, said in one note
    # line (it was silently ignored); here the finished run's refusal follows, nothing on disk changes
    code, err = main([*argv, "--resume", "--train.steps", "2", "--data.vocab_size", "2048"]), capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 2 and snapshot() == before, err
    assert err.startswith("zerotron: note: --resume keeps the checkpoint's tokenizer (data.vocab_size 512 when the run "
                          "started); data.vocab_size 2048 is ignored"), err
    # a metrics.jsonl line before the last one that is not JSON (bit rot, an edit): refused in one line
    # before anything runs (was a ValueError traceback from the step loop, exit 1); a torn last line
    # alone is dropped on resume (test_faults)
    rot = tmp_path / "rot"
    shutil.copytree(run, rot)
    lines = (rot / "metrics.jsonl").read_text().splitlines(keepends=True)
    (rot / "metrics.jsonl").write_text(lines[0][:20] + "\n" + "".join(lines[1:]))
    rotten = {p: p.read_bytes() for p in rot.rglob("*") if p.is_file()}
    code, err = main([*argv[:4], str(rot), *argv[5:], "--resume", "--train.steps", "3"]), capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"--resume: {str(rot / 'metrics.jsonl')!r} line 1 is not JSON (only a torn last line is dropped); repair " \
        "or remove that line, then resume (nothing was changed)" in err, err
    assert {p: p.read_bytes() for p in rot.rglob("*") if p.is_file()} == rotten
    # damaged checkpoints: one message each, nothing modified
    bad = tmp_path / "bad"
    shutil.copytree(run, bad)
    ck = bad / "checkpoints" / "step_2"
    for f in ck.glob("*.distcp"):
        f.unlink()
    code, err = main(["generate", "--checkpoint", str(bad), "--prompt", "x"]), capsys.readouterr().err
    assert code == 2 and "step_2' is damaged: data file" in err and "missing" in err, err
    worse = tmp_path / "worse"
    shutil.copytree(bad, worse)
    (worse / "checkpoints" / "step_2" / "meta.json").write_text('{"step": 2, "mod')
    code, err = main(["export", "--checkpoint", str(worse), "--out", str(tmp_path / "hf")]), capsys.readouterr().err
    assert code == 2 and "step_2' is damaged: meta.json is unreadable (JSONDecodeError)" in err, err
    # --resume verifies the newest checkpoint's files first and falls back to the previous one,
    # keeping the damaged directory under another name (issue 13)
    code, err = main([*argv[:4], str(bad), *argv[5:], "--resume", "--train.steps", "3"]), capsys.readouterr().err
    assert code == 0 and "step_2 is damaged (data file" in err and "falling back to step_1" in err, err
    assert (bad / "checkpoints" / "damaged_step_2").is_dir()
    assert [p.name for p in sorted((bad / "checkpoints").glob("step_*"))] == ["step_2", "step_3"]  # step_1 rotated out (keep 2)
    assert not (tmp_path / "hf").exists()



def test_export_into_its_own_run_is_refused(small_run, capsys):
    """`export --out RUN --overwrite` replaced the run's own config.json (its training config) and
    tokenizer files with the export's; --out inside the checkpoint did the same to the step. Refused
    now in one line, exit 2, nothing changed."""
    run, _ = small_run
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != ".lock"}
    step = sorted((run / "checkpoints").glob("step_*"))[-1]
    for out, what in ((run, "the run directory"), (step, "inside the checkpoint"), (step / "hf", "inside the checkpoint")):
        assert main(["export", "--checkpoint", str(run), "--out", str(out), "--overwrite"]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and f"--out {str(out)!r} is {what} of {str(run)!r}: its " \
            "config.json and tokenizer files would be replaced" in err, err
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != ".lock"} == before


def test_export_full_disk_keeps_the_previous_export(small_run, tmp_path, capsys, monkeypatch):
    """A write that fails mid-export (ENOSPC) is one line, exit 2, and leaves --out as it was, with no
    partial or staging directory. It was a traceback (exit 1: safetensors' SafetensorError is not an
    OSError), a new --out was left behind empty, and an --overwrite wrote each file in place."""
    import errno

    import zerotron.models.hf as hf

    run, _ = small_run
    out = tmp_path / "hf"
    assert main(["export", "--checkpoint", str(run), "--out", str(out)]) == 0
    capsys.readouterr()
    assert oct(out.stat().st_mode & 0o777) == oct(0o777 & ~_umask())  # a plain directory, not mkdtemp's 0700
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    real = hf.save_file

    from safetensors import SafetensorError

    def full_disk(error):
        def save(tensors, path, metadata=None):
            real(tensors, path, metadata=metadata)
            with open(path, "r+b") as f:  # what a full disk leaves: the start of the file
                f.truncate(1000)
            raise error
        return save

    # safetensors' writer raises SafetensorError on a real full disk (a 4 MiB tmpfs), json writes an OSError
    errors = [SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"),
              OSError(errno.ENOSPC, "No space left on device", str(out))]
    for error, argv in zip(errors * 2, [["--out", str(out), "--overwrite"]] * 2 + [["--out", str(tmp_path / "new")]] * 2):
        monkeypatch.setattr(hf, "save_file", full_disk(error))
        code, err = main(["export", "--checkpoint", str(run), *argv]), capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        # the path to free space at and what the export needs (was "...; free some space or choose another --out")
        where = str(tmp_path) if argv[1].endswith("new") else argv[1]
        assert f"cannot write --out {argv[1]!r}: no space left on device (it needs about " in err, err
        assert "bytes free" in err and "an existing --out is unchanged" in err, err
        assert err.rstrip().endswith(f"free some space at {where!r} or choose another --out"), err
        assert {f.name: f.read_bytes() for f in out.iterdir()} == before
        assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no staging directory, no partial "new"
    monkeypatch.setattr(hf, "save_file", real)
    assert main(["export", "--checkpoint", str(run), "--out", str(out), "--overwrite"]) == 0
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before  # the same export, replaced whole


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask

def test_device_and_backend_need_cuda(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    for flag in (["--train.device", "cuda"], ["--parallel.backend", "nccl"]):
        assert main(["train", "--config", TINY, *flag]) == 2
        assert "need a CUDA device" in capsys.readouterr().err
    assert main(["train", "--config", TINY, "--nproc", "-1"]) == 2
    assert "--nproc must be >= 1" in capsys.readouterr().err


def test_launch_refuses_more_processes_than_the_machine_holds(monkeypatch):
    """generate --nproc 100000 began to start 100,000 interpreters (the machine hung): refused first."""
    import torch.distributed.run

    from zerotron.launch import launch, max_local_nproc

    monkeypatch.setattr(torch.distributed.run, "run", lambda args: pytest.fail("launch started the workers"))
    with pytest.raises(ValueError, match=r"--nproc 100000 would start 100,000 local processes, more than \d+"):
        launch(max(100_000, max_local_nproc() + 1), ["generate"])


def test_user_error_in_the_workers_is_exit_2(tmp_path, capfd):
    """A user error that only the workers find (here generate's missing checkpoint, which --nproc
    checks in the workers alone; train's disk tier folder filled after the launcher's check is the
    same path): the line once, not once per worker (launch_worker.say_once), and the launcher exits 2
    without a 'worker 0 failed first (exit code 2) ... See its messages above' line of its own (it
    returned 1 with that line) nor torch elastic's 'failed (exitcode: 2) local_rank: ...' log line."""
    from zerotron.launch import launch
    from zerotron.launch_worker import ERROR_DIR_ENV

    code = launch(2, ["generate", "--checkpoint", str(tmp_path / "nope"), "--prompt", "hi"])
    err = capfd.readouterr().err
    assert code == 2, err
    assert "failed first" not in err and "checkpoint" in err, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("zerotron: error: "), err  # was one per worker + torch's
    assert ERROR_DIR_ENV not in os.environ


def test_worker_dies_with_launcher(tmp_path):
    """kill -9 of the launcher takes its workers with it (die_with_parent: PR_SET_PDEATHSIG)."""
    import signal
    import subprocess
    import sys
    import time

    pid_file = tmp_path / "child.pid"
    child = ("import os, time; from zerotron.launch_worker import die_with_parent; assert die_with_parent(); "
             f"open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)")
    parent = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(120)"
    p = subprocess.Popen([sys.executable, "-c", parent], start_new_session=True)
    try:
        # two interpreters start before the file appears (seconds on a loaded machine): wait for the
        # file itself while the "launcher" lives, not a fixed 10 s
        deadline = time.monotonic() + 120
        while not (pid_file.exists() and pid_file.read_text()):
            assert p.poll() is None and time.monotonic() < deadline, "the worker never started"
            time.sleep(0.05)
        pid = int(pid_file.read_text())
        os.kill(p.pid, signal.SIGKILL)  # the "launcher" dies hard
        p.wait()

        def alive():
            try:
                state = open(f"/proc/{pid}/status").read()
            except FileNotFoundError:
                return False
            return "\nState:\tZ" not in state  # a zombie waiting for init is dead
        for _ in range(200):
            if not alive():
                break
            time.sleep(0.05)
        assert not alive(), "the worker outlived its launcher"
    finally:
        if p.poll() is None:
            p.kill()


def test_prompts_file_not_utf8_names_the_file(tmp_path):
    """A Latin-1 prompts file: one line naming the file and the fix (was only "'utf-8' codec can't decode")."""
    from types import SimpleNamespace

    from zerotron.generate import read_prompts

    f = tmp_path / "prompts.txt"
    f.write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"--prompts-file '.*prompts.txt' is not UTF-8 text \(byte 3\): save it as UTF-8"):
        read_prompts(SimpleNamespace(prompts_file=str(f), prompt=None), tokenizer=None)


def test_bench_out_files_may_name_new_folders(tmp_path):
    """The bench commands create missing folders of --json/--plot/--markdown when they write: a new
    folder is accepted before the run, one under a file or under /proc is refused."""
    from zerotron.out_files import check_out_files

    check_out_files({"--json": str(tmp_path / "new" / "sub" / "r.json"), "--plot": None})
    assert not (tmp_path / "new").exists()  # checked, nothing made
    (tmp_path / "f").write_text("x")
    for bad, why in ((tmp_path / "f" / "sub" / "r.json", "is a file, not a directory"), ("/proc/new/r.json", "cannot write")):
        with pytest.raises(ValueError, match=why):
            check_out_files({"--markdown": str(bad)})


def test_prompts_file_not_a_text_file(tmp_path):
    """--prompts-file naming a directory, a device or a file that fails to read: one line saying which
    (a directory and /dev/null were "not found", /proc/self/mem an OSError traceback from the worker)."""
    from types import SimpleNamespace

    from zerotron.generate import read_prompts

    for path, why in ((tmp_path, "is a directory; pass a UTF-8 text file"),
                      ("/dev/null", r"is not a regular file \(a device or a pipe\)"),
                      ("/proc/self/mem", r"cannot be read \(Input/output error\)")):
        with pytest.raises(ValueError, match=f"--prompts-file '{path}' {why}"):
            read_prompts(SimpleNamespace(prompts_file=str(path), prompt=None), tokenizer=None)
    with pytest.raises(FileNotFoundError, match="not found"):
        read_prompts(SimpleNamespace(prompts_file=str(tmp_path / "none.txt"), prompt=None), tokenizer=None)


def test_prompts_file_too_large_is_refused_unread(tmp_path, monkeypatch):
    """A prompts file past the bound: one line, nothing read (a file of gigabytes was read whole and ran
    out of memory with a traceback); a file whose size says 0 (/proc) is not read past the bound."""
    from types import SimpleNamespace

    from zerotron import generate

    big = tmp_path / "big.txt"
    with big.open("wb") as f:  # sparse: no disk used
        f.truncate(generate.MAX_PROMPTS_FILE_BYTES + 1)
    with pytest.raises(ValueError, match=r"--prompts-file '.*big.txt' is larger than 16 MiB, the most one generate "
                                         r"run reads .*; split it into smaller files"):
        generate.read_prompts(SimpleNamespace(prompts_file=str(big), prompt=None), tokenizer=None)
    monkeypatch.setattr(generate, "MAX_PROMPTS_FILE_BYTES", 64)
    assert Path("/proc/self/maps").stat().st_size == 0  # the size a reader cannot trust
    with pytest.raises(ValueError, match="'/proc/self/maps' is larger than"):
        generate.read_prompts(SimpleNamespace(prompts_file="/proc/self/maps", prompt=None), tokenizer=None)


def test_model_too_large_for_memory_is_one_line(tmp_path, data_cache, capsys):
    """A model whose weights cannot be allocated (a 256 TB position table): one line naming the
    sizes to shrink, exit 2, and the run directory it made is gone (was torch's allocator traceback,
    exit 1, an empty run directory left)."""
    run_dir = tmp_path / "run"
    code, err = run(["train", "--config", TINY, "--model.block_size", "1000000000000", "--train.steps", "1",
                     "--run-dir", str(run_dir), "--data.cache_dir", data_cache], capsys)
    assert code == 2 and err.startswith("zerotron: error: out of host memory: an allocation of ") and \
        "shrink model.n_embd, model.n_layer, model.block_size or train.micro_batch" in err, err
    assert len(err.strip().splitlines()) == 1 and not run_dir.exists(), err
    # the windows of an absurd global batch (10**12): the sampler kept every epoch's permutation alive in a
    # list of views (growing until the OOM killer); now one array, numpy's MemoryError at once, one line
    if Path("/proc/sys/vm/overcommit_memory").read_text().strip() != "1":  # (1: 7 TiB would be granted)
        code, err = run(["train", "--config", TINY, "--train.global_batch", str(10**12), "--train.micro_batch",
                         str(10**12), "--train.steps", "1", "--run-dir", str(tmp_path / "big"), "--data.cache_dir",
                         data_cache, "--log.progress", "false", "--log.plot", "false", "--train.eval_every", "0"], capsys)
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert err.startswith("zerotron: error: out of host memory: an allocation of 7.28 TiB failed"), err
