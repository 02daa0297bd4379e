"""`uccl-ep-train` itself: a user's summary with no arguments or --help, --version, every benchmark listed
by `bench --help`, an unknown command answered with the valid ones."""
import pytest

from uccl_ep_train import __version__
from uccl_ep_train.cli import BENCHMARKS, COMMANDS, main


@pytest.mark.parametrize("argv", [[], ["--help"], ["-h"]])
def test_no_arguments_or_help_print_the_summary(argv, capsys):
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: uccl-ep-train COMMAND")
    for name in ["bench", *COMMANDS]:
        assert f"\n    {name}" in out, name


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"uccl-ep-train {__version__}"


def test_bench_help_lists_every_benchmark(capsys):
    assert main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {name}  " in out for name in BENCHMARKS)


def test_unknown_command_names_the_valid_ones(capsys):
    assert main(["frobnicate"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'frobnicate' (commands: bench, train, doctor, plan, pretrain-gpt, deep-ep-path)" in err
