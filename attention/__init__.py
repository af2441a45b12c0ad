"""Kernels under the target: the Triton tree attention of the verify forward.

:mod:`~jetflow.attention.verify_attention` chooses the verify forward's attention and builds its
mask (imports no Triton); :mod:`~jetflow.attention.tree_mask` packs a tree's ancestor matrix
into the compact bitmask; :mod:`~jetflow.attention.tree_attention` is the kernel;
:mod:`~jetflow.attention.bench` measures it against SDPA on a GPU.
"""
