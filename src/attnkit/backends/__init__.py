"""Built-in attention backends: one package per backend."""
