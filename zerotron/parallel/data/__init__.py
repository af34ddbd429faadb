"""Data parallelism: each dp rank runs the whole (stage of the) model on its share of the batch.

``ddp.py`` bucketed, overlapped gradient all-reduce (native ``DataParallel``, and torch DDP as a
comparison backend); ``zero.py`` ZeRO-1/2/3 from reduce-scatter/all-gather over flat buffers
(Rajbhandari et al. 2020; its gradient reductions in ``zero_reduce.py``, stage 3's gathering in
``zero_gather.py``, offload's copies in ``zero_offload.py``, checkpoint state in ``zero_state.py``;
one buffer ``flat_shard.py``, its optimizer state ``flat_state.py``, the buffers of the units
``flat_units.py``); ``fsdp.py`` torch FSDP2 as a comparison backend; ``used.py`` the per-step
"gradient used" flags.
"""
