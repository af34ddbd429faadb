"""Process groups as comm takes them: a :class:`NamedGroup` carries the mesh dimension's name
(the accounting key), and :func:`process_group` unwraps it for torch.distributed; :func:`new_group`
is how zerotron makes a group outside the mesh (with the run's collective timeout)."""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class NamedGroup:
    """A ProcessGroup with the name of the mesh dimension it spans (``"dp"``, ``"tp"``, ``"pp"``).

    Two mesh dimensions may share one underlying ProcessGroup object (e.g. when a degree is 1), so
    the name travels with the handle rather than being looked up from the group."""

    pg: object
    name: str

    def size(self) -> int:
        return dist.get_world_size(self.pg)

    def rank(self) -> int:
        return dist.get_rank(self.pg)


def process_group(group):
    """The torch ProcessGroup of ``group`` (a NamedGroup's ``pg``; anything else as it is)."""
    return group.pg if isinstance(group, NamedGroup) else group


def group_name(group) -> str:
    """Accounting name of ``group``: its NamedGroup name, ``"world"`` for ``None``."""
    if isinstance(group, NamedGroup):
        return group.name
    return "world" if group is None or group is dist.GroupMember.WORLD else "group"


def group_ranks(group) -> list[int]:
    """The global ranks of ``group`` (``None``: the world); ``[]`` when they cannot be looked up."""
    try:
        return list(dist.get_process_group_ranks(process_group(group) or dist.GroupMember.WORLD))
    except (RuntimeError, ValueError, AttributeError):
        return []


def world_timeout():
    """The collective timeout of the default process group (``parallel.timeout_s``, given to
    ``init_process_group`` by ``mesh.init_distributed``) as a timedelta, or None when there is none
    to read (torch 2.x private API: the backend's options)."""
    import torch

    for device in ("cpu", "cuda"):
        try:
            return dist.group.WORLD._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError, ValueError):
            continue
    return None


def new_group(ranks=None, backend=None):
    """``dist.new_group(ranks, backend)`` (collective over the world, as torch's) with the default
    group's collective timeout (:func:`world_timeout`). torch gives a group made by ``new_group``
    its own 30-minute default, not the world's (DeviceMesh's groups do inherit it): a dead or hung
    peer in such a group -- a background checkpoint save's, a pipeline's tied pair, an expert group
    -- held the other ranks for 30 minutes instead of ``parallel.timeout_s``."""
    return dist.new_group(ranks, backend=backend, timeout=world_timeout())
