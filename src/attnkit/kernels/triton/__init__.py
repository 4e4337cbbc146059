"""Triton kernels. Importing a module here imports triton; ``import attnkit`` never does."""
