"""Peers of the benchmarks, one module each.

* ``torch_sdpa``: torch SDPA per dilated segment (head_groups and longnet; self-contained,
  independent of jax_dilated).
* ``dilated_attention_pytorch``: the PyPI ``dilated-attention-pytorch`` library's
  ``DilatedAttention`` on CPU through an xformers shim (head_groups; timed only).
* ``jax_per_segment``: ``jax.nn.dot_product_attention`` per dilated segment (the naive
  JAX way), and the gather/scatter the JAX peers share.
* ``tokamax_per_segment``: ``tokamax.dot_product_attention`` (XLA) per dilated segment.
* ``ringattention``: the ``ringattention`` package inside ``shard_map`` (the ring op).
* ``gigapath``: Prov-GigaPath's own PyTorch slide encoder, imported from a checkout given
  at run time (``--gigapath-src``), with torch's CPU flash kernel standing in for
  flash-attn (the slide op).

Peers outside the standard library, JAX and jax_dilated are imported lazily;
``bash benchmarks/setup.sh`` installs them.
"""
