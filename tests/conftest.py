"""Test-session set-up shared by every test module."""

from __future__ import annotations

import os

import torch

# Triton kernels run on CPU tensors only under the Triton interpreter. The variable
# must be set before triton is first imported, so it is set here, at collection time.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
