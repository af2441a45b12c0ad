"""Kernels under the target: the Triton tree attention of the verify forward.

:mod:`~jetflow.kernels.verify_attention` chooses the verify forward's attention and builds its
mask (imports no Triton); :mod:`~jetflow.kernels.tree_mask` packs a tree's ancestor matrix
into the compact bitmask; :mod:`~jetflow.kernels.tree_attention` is the kernel;
:mod:`~jetflow.kernels.bench` measures it against SDPA on a GPU.
"""
