"""Pipeline parallelism: stages over the pp dimension.

``schedules.py`` action lists (GPipe, 1F1B, interleaved; naive model parallel) and bubble theory;
``executor.py`` the stage model (a rank's part of any model, by its layout) and the walker of its
action list; ``runner.py`` ``PipelineStrategy`` (stage split, tied weights, the rank's gradient
synchroniser: ZeRO-1/2/3 of a rank's stages through the plain runner's driver, ``data.zero.ZeroSync``),
which joins ``flushes.py`` (a step's micro-batches in flushes, forward-only evaluation, timing),
``grads.py`` (gradient sums after the backward, norm, optimizer) and ``state.py`` (canonical
checkpoint state and ``full_params``); ``generate.py`` pipelined generation.
"""
