"""Paged attention over the KV cache ``[NB, 2, BS, Hkv, D]``: every attention kind's op.

* ``contract``: the argument rules both implementations share (mask options, soft-cap,
  per-head vectors, scales, the batch metadata, the context-parallel shard) and the
  Triton launchers' metadata rules;
* ``reference``: pure torch (``paged_attention``, ``dense_attention``, ``write_kv_cache``);
* Triton: ``triton`` (the launchers ``paged_attention`` and ``merge_split_kv``, and the
  design notes), ``triton_plan`` (``plan_paged_attention``, the split-KV heuristic and
  workspace, the launch shapes), ``triton_kernels`` (the one-pass and split-KV
  ``@triton.jit`` kernels), ``triton_tile`` (the key tile both kernels share, and MLA's
  kernel), ``triton_kv_write`` (``write_kv_cache``), ``triton_unified`` and
  ``triton_split_kv`` (plan-and-launch wrappers);
* CPU engines: ``cpu_decode`` (the native decode kernel ``paged_decode.c``, built and
  loaded by ``cpu_native``) and ``cpu_prefill`` (blocked matrix products).
"""
