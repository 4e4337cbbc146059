"""An out-of-tree attnkit backend for chunked local attention (Llama 4 style)."""

from __future__ import annotations

from .backend import (
    ChunkedLocalBackend,
    ChunkedLocalBuilder,
    ChunkedLocalImpl,
    ChunkedLocalMetadata,
)

__all__ = ["ChunkedLocalBackend", "ChunkedLocalBuilder", "ChunkedLocalImpl", "ChunkedLocalMetadata"]
