"""Backends behind Buffer: `reference` (torch.distributed oracle) and `native` (the _native module)."""
