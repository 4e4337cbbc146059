"""Causal depthwise conv1d with per-request state in a cache (Mamba's short convolution).

``contract`` (the checks both implementations share), ``reference`` (pure torch) and
``triton`` (the Triton kernels and launchers): ``causal_conv1d_varlen`` and
``causal_conv1d_update`` in both.
"""
