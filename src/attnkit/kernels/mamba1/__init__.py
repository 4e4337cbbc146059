"""Mamba (1) selective scan with per-request states in a cache.

``contract`` (the checks both implementations share), ``reference`` (pure torch, with
the layer's projections) and ``triton``: ``selective_scan_varlen`` and
``selective_scan_update`` in both.
"""
