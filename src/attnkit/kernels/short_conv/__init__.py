"""LFM2's gated short convolution with per-request state in a cache.

``contract`` (the checks both implementations share; the convolution's own parameters
follow :mod:`attnkit.kernels.conv1d.contract`), ``reference`` (pure torch) and
``triton``: ``short_conv_varlen`` and ``short_conv_update`` in both.
"""
