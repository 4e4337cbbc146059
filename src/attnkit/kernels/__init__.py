"""Kernels and their launchers.

Nothing here knows attnkit's specs, builders or backends: kernels take tensors and
plain numbers. ``kernels.torch`` holds pure-torch references (the oracles);
``kernels.triton`` holds Triton kernels, imported only by the backends that use them.

Every launcher checks its arguments before it launches anything: ``TypeError`` for an
argument of the wrong Python type, ``ValueError`` for a value, shape, dtype, device or
stride the kernel cannot take, each naming the argument, what was given and what is
allowed (helpers in ``kernels._checks``). The Triton launchers read tensor metadata
only, never a device value; the torch oracles also check index values on the host.
"""
