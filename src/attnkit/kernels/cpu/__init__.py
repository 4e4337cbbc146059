"""CPU attention engines over the paged K/V planes (``[NB * BS, Hkv, D]``, row = slot).

* ``decode``: a native kernel (C, compiled once per machine with the system compiler
  and cached on disk) for query rows that see a contiguous range of keys: decodes and
  short speculative runs. It reads K and V in place through the block table.
* ``prefill``: longer query runs as blocked matrix products (torch's BLAS) over the
  request's keys gathered once, with the kind's mask applied per query block.

Both take tensors and plain numbers only (the kernels package's rule); the
``flex_attention`` backend plans a step onto them on CPU.
"""
