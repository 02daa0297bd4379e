"""The applications built on the library: the `uccl-ep-train` command line (cli), training (train, data,
recipes), planning (plan), the machine check (doctor), the benchmarks (bench) and the one way they spawn
ranks (launch).

They sit on top of `megatron_patch`, which sits on the library (`uccl_ep_train` without this subpackage):
imports go apps -> megatron_patch -> library -> backends -> native module, never back, so the library
installs and imports without megatron-core or the applications' extras (tests/test_library_imports.py)."""
