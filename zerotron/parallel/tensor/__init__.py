"""Tensor (Megatron) and sequence parallelism (Shoeybi et al. 2019; Korthikanti et al. 2022).

``ops.py`` the f / g communication operators (autograd functions over the tp group); ``layers.py``
column/row-parallel Linear, vocab-parallel embedding and the per-parameter ``TPShard`` record;
``loss.py`` the vocab-parallel cross-entropy; ``transform.py`` the in-place transform of any model
by its layout description, the dropout RNG tracker, gradient sync and dense <-> shard state.
"""
