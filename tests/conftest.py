import os

# One intra-op thread in the pytest process and in every process it starts (CLI runs, launched
# workers, pooled ranks; zerotron.testing_pool.run_job does the same): the test models are too small to
# gain from a second thread, whose OpenMP spin-waits take a core from the other processes -- a
# 2-step single-process `zerotron train` of configs/tiny.toml took 12.96 user CPU s with torch's
# default 2 threads and 4.31 with one (7.61 vs 4.31 in a second pair, load 11) (benchmarks/suite_durations.md). Set before torch loads (the
# OpenMP runtime reads it then); an OMP_NUM_THREADS in the environment wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The workers of every `--nproc N` launch the tests start are forks of their launcher, which imported
# torch and the training stack once, instead of N fresh interpreters (~3 CPU s of imports each):
# zerotron.launch_fork (failure reports and process parentage as with exec'd workers). A test about
# the fresh worker interpreter itself sets ZEROTRON_FORK_WORKERS=0 in the environment it passes.
os.environ.setdefault("ZEROTRON_FORK_WORKERS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from zerotron.testing import tiny_config  # noqa: E402

if os.environ["OMP_NUM_THREADS"].isdigit():
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory):
    """A token cache of the tiny config's corpus, built once per session (vocab 512)."""
    from zerotron.data import prepare_data

    cache = tmp_path_factory.mktemp("cache")
    d = tiny_config({"data.cache_dir": cache}).data
    prepare_data(d.corpus, None, d.text_field, d.vocab_size, d.val_fraction, d.cache_dir)
    return str(cache)


@pytest.fixture(scope="session")
def single_process():
    """A world-size-1 default process group in the pytest process (reference runs)."""
    from zerotron.distributed.mesh import init_distributed

    init_distributed("gloo", timeout_s=60)
    yield


@pytest.fixture(scope="session")
def chat_tokenizer(tmp_path_factory):
    """A Llama-3-style tokenizer trained on the shipped chat rows (``configs/chat_example.jsonl``),
    built once per session (test_finetune, test_sft_packing)."""
    from zerotron.data.dataset import _row_texts
    from zerotron.data.example import llama3_style_tokenizer
    from zerotron.data.sft import read_rows

    out = tmp_path_factory.mktemp("chat_tok")
    return llama3_style_tokenizer([t for _, r in read_rows("configs/chat_example.jsonl") for t in _row_texts(r)],
                                  1000, out)


_REPORT = "zerotron-report"

# `make test` runs the files on two pytest-xdist workers (--dist loadfile --no-loadscope-reorder), each
# file whole on one worker, handed out in collection order as workers free up: the longest files go
# first (longest-processing-time first keeps the two workers' ends close; seconds of the idle
# 2-core run of 2026-12-04 16:27, whole file incl. setup), the rest keep their order.
LONG_FILES = ("test_parity_matrix.py",  # ~590 s
              "test_faults.py", "test_tp_train.py", "test_3d.py", "test_moe_parity.py",  # 200-80 s
              "test_continuous.py", "test_readme.py", "test_serve.py", "test_compile.py", "test_two_nodes.py",
              "test_dryrun.py", "test_pipeline.py", "test_compose.py")


def pytest_collection_modifyitems(config, items):
    first = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: a file's own order kept


@pytest.fixture
def report(request):
    """``report(line)``: a line printed in pytest's terminal summary even without ``-s`` (counts
    and worst errors that CI logs should show). The line travels in the test's report
    (``user_properties``), so an xdist worker's lines reach the controller's summary."""
    return lambda line: request.node.user_properties.append((_REPORT, str(line)))


def pytest_terminal_summary(terminalreporter):
    seen = set()
    for reports in terminalreporter.stats.values():
        for rep in reports:
            for key, line in getattr(rep, "user_properties", ()) or ():
                if key == _REPORT and (rep.nodeid, line) not in seen:
                    seen.add((rep.nodeid, line))
                    terminalreporter.write_line(line)
