import os

import pytest
import torch

from zerotron.testing import tiny_config

# One intra-op thread in the pytest process (references, in-process runs), as in every rank
# (zerotron.testing._run_job): the test models are too small to gain from a second thread, whose
# OpenMP waits take a core from the ranks and the CLI children (benchmarks/suite_durations.md).
# An OMP_NUM_THREADS in the environment wins.
if "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(1)


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


_SUMMARY: list[str] = []


@pytest.fixture
def report():
    """``report(line)``: a line printed in pytest's terminal summary even without ``-s`` (counts
    and worst errors that CI logs should show)."""
    return _SUMMARY.append


def pytest_terminal_summary(terminalreporter):
    for line in _SUMMARY:
        terminalreporter.write_line(line)
