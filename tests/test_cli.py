"""`uccl-ep-train` itself: a user's summary with no arguments or --help, --version, every benchmark listed
by `bench --help`, an unknown command answered with the valid ones."""
import pytest

from uccl_ep_train import __version__
from uccl_ep_train.apps.cli import BENCHMARKS, COMMANDS, main


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
    assert "unknown command 'frobnicate' (commands: bench, train, doctor, plan, pretrain-gpt, deep-ep-path, install-deep-ep)" in err


def test_one_spelling_across_benchmarks():
    """The same option means the same thing in every benchmark: --ranks (DeepEP's --num-processes too),
    --num-tokens / --num-topk / --num-experts (the short forms too), --sms as a comma list, --json PATH."""
    from uccl_ep_train.apps.bench import expert_major, internode, intranode, megatron, proxy

    parsers = {"intranode": intranode._parse, "internode": internode.build_parser().parse_args,
               "megatron": megatron.build_parser().parse_args, "expert-major": expert_major.build_parser().parse_args}
    for name, parse in parsers.items():
        for ranks in ("--ranks", "--num-processes"):
            a = parse([ranks, "3", "--num-tokens", "64", "--num-topk", "2", "--num-experts", "8", "--json", "r.json"])
            assert (a.ranks, a.num_tokens, a.num_topk, a.num_experts, a.json) == (3, 64, 2, 8, "r.json"), name
        a = parse(["--tokens", "32", "--topk", "4", "--experts", "16"])
        assert (a.num_tokens, a.num_topk, a.num_experts) == (32, 4, 16), name
        if name != "megatron":  # a sweep; megatron takes one count (Megatron's --uccl-ep-num-sms)
            assert parse(["--sms", "8,16"]).sms == [8, 16], name
    assert megatron.build_parser().parse_args(["--sms", "24"]).num_sms == 24
    with pytest.raises(SystemExit):
        intranode._parse(["--sms", "8;16"])
    a = proxy._parse(["--threads", "1,4", "--chunk-bytes", "65536", "1048576", "--ops", "single,ipc"])
    assert (a.threads, a.chunk_bytes, a.ops) == ([1, 4], [65536, 1048576], ["single", "ipc"])
    with pytest.raises(SystemExit):
        proxy._parse(["--ops", "single,nope"])


def test_every_benchmark_module_is_listed():
    """BENCHMARKS lists every module of uccl_ep_train.apps.bench (dashes for underscores), and only those."""
    import pkgutil

    from uccl_ep_train.apps import bench

    modules = {m.name.replace("_", "-") for m in pkgutil.iter_modules(bench.__path__)}
    assert modules == set(BENCHMARKS)


@pytest.mark.parametrize("argv", [["train"], ["pretrain-gpt"], ["bench", "megatron"]])
def test_commands_driving_megatron_name_the_extra_without_it(argv, capsys, monkeypatch):
    from uccl_ep_train.apps import cli

    real = cli.importlib.util.find_spec
    monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name, *a: None if name == "megatron" else real(name, *a))
    assert main(argv) == 2
    assert "needs megatron-core (pip install 'uccl-ep-train[megatron]')" in capsys.readouterr().err


def test_unknown_benchmark_is_named(capsys):
    assert main(["bench", "frobnicate"]) == 2
    assert "command 'bench frobnicate' is not available" in capsys.readouterr().err


def test_train_help_names_where_the_log_goes_and_the_output_switches(capsys):
    """`train --help`: the JSON log and the plot under runs/train/, --quiet, --verbose, --log-every."""
    with pytest.raises(SystemExit) as done:
        main(["train", "--help"])
    assert done.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "JSON log path (default runs/train/<dispatcher>.json)" in out
    assert "the JSON log's, ending .png" in out
    for option in ("--quiet", "--verbose", "--log-every"):
        assert option in out, option
