"""Building blocks every Triton kernel of attnkit shares (importing any of them imports
triton; ``import attnkit`` never does).

* :mod:`.interpret`: whether the kernels were defined for the Triton interpreter;
* :mod:`.fp8`: the exact float8 e4m3fn decoder and encoder the kernels use under it;
* :mod:`.rounding`: bfloat16 round-to-nearest by hand (the interpreter truncates);
* :mod:`.activations`: elementwise functions several kernels use (``softplus``);
* :mod:`.varlen`: a varlen batch on the device (request lookup by binary search over
  cumulative offsets, chunk bounds) and the launchers' flag views.

An op's own device functions live in its package (``kernels/<op>/triton*.py``).
"""
