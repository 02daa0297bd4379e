"""A stand-in of AMD-AGI/Primus for tests (never on the import path otherwise): its patch registry and
runner (`primus.core.patches`) and its CLI's training path (`primus.cli.main`), reduced to what
megatron_patch.primus meets, with Primus's behaviour where ours depends on it: the phases run in Primus's
order, run_patches logs a patch's Exception and goes on, and the runtime turns any failure into exit status 1.
"""
