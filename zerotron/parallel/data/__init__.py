"""Data parallelism: each dp rank runs the whole (stage of the) model on its share of the batch.

``ddp.py`` bucketed, overlapped gradient all-reduce (native ``DataParallel``, and torch DDP as a
comparison backend); ``zero.py`` ZeRO-1/2/3 from reduce-scatter/all-gather over flat buffers
(``flat_shard.py``, checkpoint state in ``zero_state.py``; Rajbhandari et al. 2020); ``fsdp.py``
torch FSDP2 as a comparison backend; ``used.py`` the per-step "gradient used" flags.
"""
