"""Kernels and their launchers.

Nothing here knows attnkit's specs, builders or backends: kernels take tensors and
plain numbers. ``kernels.torch`` holds pure-torch references (the oracles);
``kernels.triton`` holds Triton kernels, imported only by the backends that use them.
"""
