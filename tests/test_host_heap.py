"""zerotron.host_heap: glibc's heap thresholds fixed in the processes that run steps (issue 27)."""
import os
import subprocess
import sys
import textwrap

import pytest

from zerotron import host_heap

GLIBC = host_heap.wanted({})

# a 48 MiB block, above glibc's largest dynamic mmap threshold (32 MiB on 64-bit): under the defaults
# every malloc of it is a fresh mmap whose pages fault in again; with "retain" it comes from the heap
_FAULTS = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})
    from zerotron.host_heap import block_faults, retain
    if {retain}:
        assert retain()
    print(block_faults(48 << 20, 4))
""")


def _faults(retain: bool) -> int:
    root = os.path.dirname(os.path.dirname(os.path.abspath(host_heap.__file__)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", _FAULTS.format(root=root, retain=retain)], env=env,
                         capture_output=True, text=True, check=True).stdout
    return int(out)


def test_wanted_respects_the_users_setting():
    assert host_heap.wanted({"ZEROTRON_HOST_HEAP": "release"}) is False
    assert host_heap.wanted({"MALLOC_MMAP_THRESHOLD_": "131072"}) is False
    assert host_heap.wanted({"MALLOC_TRIM_THRESHOLD_": "0"}) is False
    assert host_heap.wanted({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=4096"}) is False
    assert host_heap.wanted({"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX"}) is GLIBC  # not a malloc tunable
    assert host_heap.wanted({"ZEROTRON_HOST_HEAP": "Retain"}) is GLIBC
    with pytest.raises(ValueError, match="ZEROTRON_HOST_HEAP must be retain or release"):
        host_heap.wanted({"ZEROTRON_HOST_HEAP": "keep"})
    assert host_heap.worker_env({"ZEROTRON_HOST_HEAP": "release"}) == {}
    if GLIBC:
        assert host_heap.worker_env({}) == {"MALLOC_MMAP_THRESHOLD_": str(64 << 20),
                                            "MALLOC_TRIM_THRESHOLD_": str(256 << 20)}


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_retain_stops_the_page_faults_of_a_reused_block():
    """4 rounds of malloc/touch/free of 48 MiB: under glibc's defaults each round faults its 12,288
    pages in again; with the thresholds retained the block is reused (a few faults at most)."""
    pages = (48 << 20) // os.sysconf("SC_PAGE_SIZE")
    default, retained = _faults(False), _faults(True)
    assert default >= 4 * pages * 0.9, default
    assert retained < pages * 0.1, retained


def test_a_bad_setting_is_one_line_and_exit_2():
    env = {**os.environ, "ZEROTRON_HOST_HEAP": "keep"}
    r = subprocess.run([sys.executable, "-m", "zerotron", "plan", "--help"], env=env, capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == "zerotron: error: ZEROTRON_HOST_HEAP must be retain or release, got 'keep'"
