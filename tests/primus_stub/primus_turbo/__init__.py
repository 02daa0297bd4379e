"""A stand-in of AMD-AGI/Primus-Turbo for tests: only its EP backend registry and the calls its MoE
dispatch/combine make into a backend (pytorch/kernels/moe/moe_dispatch_combine_impl.py)."""
