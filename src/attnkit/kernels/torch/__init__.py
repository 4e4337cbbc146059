"""Pure-torch reference kernels: written for clarity, float32 accumulation."""
