"""How a failed ``--nproc`` launch is told: which worker failed first (:func:`first_failure`), the one
line that names it (:func:`describe_failures`), and the worker exit codes that mean "stopped on
purpose" (:data:`QUIET_EXIT_CODES`), after which a restart would only repeat the failure
(:data:`NO_RESTART_EXIT_CODES`). Pure functions of torch elastic's ``ProcessFailure`` records.
"""
from __future__ import annotations

import signal

# worker exit codes that mean "stopped on purpose; rank 0 printed the reason": a guard (3, see
# train.lifecycle) or a graceful stop after signal S (128 + S)
QUIET_EXIT_CODES = (3, 128 + signal.SIGHUP, 128 + signal.SIGINT, 128 + signal.SIGTERM)


_STOPPED_BY_AGENT = (-signal.SIGTERM, 128 + signal.SIGTERM)  # what the agent's SIGTERM leaves

# exit codes after which a restart would only repeat the failure: 2 (a user error) and the quiet ones
NO_RESTART_EXIT_CODES = (2, *QUIET_EXIT_CODES)


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        text = f"killed by {name}"
        if -code == signal.SIGKILL:
            text += ": possibly out of memory (check dmesg)"
        return text
    return f"exit code {code}"


def _killed_by_signal(code) -> bool:
    return isinstance(code, int) and code < 0


def first_failure(failures: dict) -> int:
    """The global rank that failed first among ``failures`` (see :func:`describe_failures`)."""
    culprits = {r: f for r, f in failures.items() if f.exitcode not in _STOPPED_BY_AGENT} or failures
    t0 = min(getattr(f, "timestamp", 0) for f in culprits.values())
    # a kill by a signal goes first only within torch elastic's 1 s timestamp resolution of the
    # earliest failure: one seconds later is the agent's SIGKILL of a worker that ignored its SIGTERM
    # (a stopped or hung worker, 30 s after a peer failed)
    return min(culprits, key=lambda r: (not (_killed_by_signal(culprits[r].exitcode)
                                             and getattr(culprits[r], "timestamp", 0) <= t0 + 1),
                                        getattr(culprits[r], "timestamp", 0), r))


def describe_first_failure(failures: dict) -> str:
    """``"worker R died (killed by SIGKILL: ...)"`` or ``"worker R failed (exit code C)"`` for the
    worker that failed first (``failures`` must not be empty)."""
    first = first_failure(failures)
    code = failures[first].exitcode
    return f"worker {first} {'died' if _killed_by_signal(code) else 'failed'} ({_exit_text(code)})"


def describe_failures(failures: dict) -> str:
    """One line naming the worker that failed FIRST (``failures``: global rank -> torch elastic
    ProcessFailure, with ``exitcode`` and ``timestamp``). Workers that the agent stopped with SIGTERM
    after another failed are victims, not culprits: the culprit is the earliest failure (then the
    lowest rank) among those that did not end by SIGTERM; only if every worker did is it the earliest.
    A worker killed by a signal (kill -9, out of memory) comes before workers that exited with a code:
    its peers then fail their next collective (connection reset, exit 1) within the same second, and
    torch elastic's timestamps have one-second resolution. A kill more than a second after the
    earliest failure is ordered by time (the agent SIGKILLs a hung worker 30 s after a peer failed)."""
    if not failures:
        return "a worker failed; the other workers were stopped. See the messages above."
    culprits = {r: f for r, f in failures.items() if f.exitcode not in _STOPPED_BY_AGENT} or failures
    first = first_failure(failures)
    others = sorted(r for r in failures if r != first)
    line = f"worker {first} failed first ({_exit_text(failures[first].exitcode)})"
    if len(culprits) > 1:
        line += f"; also failed: {sorted(r for r in culprits if r != first)}"
    victims = [r for r in others if r not in culprits]
    if victims:
        line += f"; the agent then stopped worker(s) {victims}"
    return line + ". See its messages above."
