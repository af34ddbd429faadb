"""Context parallelism: the sequence of every micro-batch split over the ``cp`` ranks.

* :mod:`.split` -- the load-balanced ("zigzag") split of a sequence over cp ranks and its inverse;
* :mod:`.attention` -- ``context_attention``: causal attention of a rank's local chunks against the
  whole sequence, dispatched to an implementation (``parallel.cp_impl``).

Everything outside attention (embeddings, MLPs, norms, loss) works on the local chunk unchanged;
each token keeps its global position (RoPE / learned positions). Sources: Ring Attention (Liu et al.
2023), DeepSpeed-Ulysses (Jacobs et al. 2023), the zigzag split of ring-flash-attention / Megatron-LM
context parallelism, Llama 3 (2024) section 3.3.2.
"""
