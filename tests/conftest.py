import pytest

from zerotron.testing import tiny_config


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


_SUMMARY: list[str] = []


@pytest.fixture
def report():
    """``report(line)``: a line printed in pytest's terminal summary even without ``-s`` (counts
    and worst errors that CI logs should show)."""
    return _SUMMARY.append


def pytest_terminal_summary(terminalreporter):
    for line in _SUMMARY:
        terminalreporter.write_line(line)
