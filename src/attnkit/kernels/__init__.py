"""Kernels and their launchers, one package per op (``kernels/<op>/``).

Each op holds its contract (``contract.py``: the shape, dtype and argument checks both
implementations share), its pure-torch reference (``reference.py``, the oracle), its
Triton kernels (``triton.py`` and, where one op has several, ``triton_*.py``) and its
CPU engines (``cpu_*.py``). Ops: ``attention`` (paged attention, KV write, CPU decode
and prefill), ``mla``, ``merge`` (``merge_attn_states``), ``conv1d``, ``short_conv``,
``mamba1``, ``mamba2``, ``gated_delta``, ``linear_attention``. What every op shares:
``_checks`` (argument and tensor checks) and ``_triton`` (the Triton building blocks).

Nothing here knows attnkit's specs, builders or backends: kernels take tensors and
plain numbers. Importing an op's Triton modules imports triton; nothing else here does,
and only the backends that use them import them.

Every launcher checks its arguments before it launches anything: ``TypeError`` for an
argument of the wrong Python type, ``ValueError`` for a value, shape, dtype, device or
stride the kernel cannot take, each naming the argument, what was given and what is
allowed (helpers in ``kernels._checks``). The Triton launchers read tensor metadata
only, never a device value; the torch oracles also check index values on the host.
"""
