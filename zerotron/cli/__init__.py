"""Command line: ``zerotron train | generate | serve | export | memory | plan | schedule | bench``.

Every user error (config, file, checkpoint, shape) ends in one line ``zerotron: error: ...`` on
stderr and exit code 2; nothing already on disk is modified by a run that fails validation.

Modules: ``main`` (usage, version, dispatch), ``errors`` (the one-line error and what counts as a
user error), one per command group: ``train``, ``generate``, ``export``, ``bench``; ``memory``,
``plan`` and ``schedule`` live in ``zerotron.analysis``, ``serve`` in ``zerotron.serve``.
"""
from .main import main

__all__ = ["main"]
