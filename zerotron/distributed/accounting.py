"""Traffic accounting of comm: calls and bytes per ``(op, group name, tag)`` in one process-wide
:data:`STATS`, and the nccl-tests bus-bandwidth factors for those sizes.

Byte accounting follows the nccl-tests convention for the "size" of a collective:
  * all_reduce, broadcast, reduce: the tensor's bytes;
  * all_gather (into tensor): the *output* bytes (world_size x input);
  * reduce_scatter (tensor): the *input* bytes (world_size x output);
  * all_to_all: the input bytes; send/recv: the tensor's bytes.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from .groups import group_name


def _ranks(group) -> tuple:
    """Global ranks of ``group`` (a NamedGroup, a ProcessGroup or None = the default group); () when
    torch.distributed is not initialised."""
    import torch.distributed as dist

    from .groups import process_group

    if not dist.is_initialized():
        return ()
    pg = process_group(group)
    if pg is None or pg is dist.GroupMember.WORLD:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(pg))


@dataclass
class CommStats:
    """Counts of collective calls and bytes, keyed by ``(op, group_name, tag)``.

    ``calls[key]`` is an int; ``bytes[key]`` is an int (bytes, nccl-tests size convention);
    ``members[group_name]``: the global ranks of the group counted under that name since the last
    reset (which links a group crosses: ``zerotron.analysis.trace_time``).
    """

    calls: dict = field(default_factory=lambda: defaultdict(int))
    bytes: dict = field(default_factory=lambda: defaultdict(int))
    members: dict = field(default_factory=dict)

    def record(self, op: str, group, tensor_bytes: int, tag: str = "") -> None:
        name = group_name(group)
        key = (op, name, tag)
        self.calls[key] += 1
        self.bytes[key] += int(tensor_bytes)
        if name not in self.members:
            self.members[name] = _ranks(group)

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()
        self.members.clear()

    def total_bytes(self, op: str | None = None, group: str | None = None, tag: str | None = None) -> int:
        """Sum of bytes over keys matching the given filters (``None`` matches anything)."""
        return sum(v for k, v in self.bytes.items() if _match(k, op, group, tag))

    def total_calls(self, op: str | None = None, group: str | None = None, tag: str | None = None) -> int:
        """Sum of call counts over keys matching the given filters."""
        return sum(v for k, v in self.calls.items() if _match(k, op, group, tag))

    def snapshot(self) -> dict:
        """A JSON-friendly copy: ``{"op/group/tag": {"calls": n, "bytes": b}}``."""
        return {"/".join(k): {"calls": self.calls[k], "bytes": self.bytes[k]} for k in sorted(self.calls)}


def _match(key, op, group, tag) -> bool:
    return (op is None or key[0] == op) and (group is None or key[1] == group) and (tag is None or key[2] == tag)


STATS = CommStats()


def busbw_factor(op: str, n: int) -> float:
    """Bus-bandwidth factor of the nccl-tests convention (busbw = algbw x factor) for ``n`` ranks.

    all_reduce 2(n-1)/n; all_gather, reduce_scatter and all_to_all (n-1)/n; broadcast, reduce,
    send/recv 1. Source: NVIDIA nccl-tests, doc/PERFORMANCE.md.
    Raises ValueError for an unknown op."""
    if n < 1:
        raise ValueError(f"busbw_factor: n must be >= 1, got {n}")
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op in ("broadcast", "reduce", "send", "recv", "p2p"):
        return 1.0
    raise ValueError(f"busbw_factor: unknown op {op!r}")
