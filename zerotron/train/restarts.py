"""Automatic restarts (``zerotron train --max-restarts N``, or ``torchrun --max-restarts N``): the
elastic agent starts the workers again with ``TORCHELASTIC_RESTART_COUNT`` = 1, 2, ...
(:func:`restart_count`). A restarted worker resumes from the newest good checkpoint of the run
directory, as ``--resume`` does, also when the original command had no ``--resume``; with no
checkpoint yet it starts from step 0 and replaces what the failed attempt logged. The launcher of
``--nproc`` keeps holding the run lock across restarts and says the one line
(:func:`prepare_restart`); under torchrun, rank 0 of each attempt takes the lock again (the dead
attempt's flock went with its process). The agent stops the surviving workers of a failed attempt
with SIGTERM; :func:`restart_note` tells them that this SIGTERM is for a restart.
"""
from __future__ import annotations

import os
from pathlib import Path

from .checkpoint import CheckpointError, list_checkpoints, newest_good_checkpoint, read_meta
from .checkpoint.files import remove_stale_tmp
from .stop import restart_note  # noqa: F401 (API: restarts.restart_note)


def restart_count() -> int:
    """How many times torch elastic restarted this worker's group (``TORCHELASTIC_RESTART_COUNT``;
    0 in the first attempt and outside torchrun / ``--nproc``)."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    except ValueError:
        return 0


def prepare_restart(run_dir: str | Path) -> str:
    """Between two attempts of ``--max-restarts`` (the old workers are stopped; called by the
    launcher, which holds the run lock): remove the ``.tmp_step_*`` of a save the failure cut
    short, find the newest good checkpoint (verifying checksums; a damaged one is quarantined as
    ``damaged_step_<N>`` with a warning) and record it in ``ZEROTRON_CKPT_VERIFIED`` so the new
    workers do not hash it again. Returns where the new workers start, for the restart line."""
    remove_stale_tmp(run_dir)
    if not list_checkpoints(run_dir):
        return "no checkpoint yet, the workers start again from step 0"
    try:
        path = newest_good_checkpoint(run_dir, quarantine=True)
    except CheckpointError as e:
        return f"the workers will fail: {e}"
    os.environ["ZEROTRON_CKPT_VERIFIED"] = str(path)  # the agent copies this environment into the workers
    return f"the workers resume from step {read_meta(path).get('step')} ({path})"

