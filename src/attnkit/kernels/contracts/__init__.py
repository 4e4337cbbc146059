"""Per-op contracts: the shape, dtype and argument checks an op's torch oracle and its
Triton launcher share (one module per op), so both sides enforce the same rules and
neither imports the other's private helpers."""
