"""The fuzz generator (tests/fuzz_cases.py) and runner (tests/fuzz_runner.py) on CPU: deterministic per seed,
every listed dimension covered over a few hundred seeds, only valid cases, and a sample of them run on CPU
ranks with the reference backend under test (checked against the reference and the dense oracle), so the
GPU fuzz suite's machinery is covered without a GPU."""
from __future__ import annotations

import re

import pytest
import torch

import fuzz_cases as F
from oracle import capacity_overflows, drop_over_capacity
from fuzz_runner import main as fuzz_main
from fuzz_runner import run_cases

SEEDS = range(300)


@pytest.fixture(scope="module")
def cases() -> list[F.FuzzCase]:
    return [c for s in SEEDS for c in F.generate(s)]


def test_a_seed_gives_the_same_cases_and_inputs_every_time():
    for seed in (0, 7, 123):
        a, b = F.generate(seed), F.generate(seed)
        assert a == b and [c.repro for c in a] == [f"scripts/fuzz_gpu.sh --seed {seed} --case {i}"
                                                    for i in range(F.CASES_PER_SEED)]
        assert F.case(seed, 3) == a[3]
        for c in a[:3]:
            for rank in range(c.world):
                for t, u in zip(F.rank_inputs(c, rank), F.rank_inputs(c, rank)):
                    assert torch.equal(t, u)
    assert F.generate(1) != F.generate(2)


def test_every_case_is_valid(cases):
    for c in cases:
        F.check_case(c)
        assert len({c.layout for c in F.generate(c.seed)}) == 1  # one spawn per seed
    bad = F.case(0, 0)
    with pytest.raises(ValueError, match="--seed 0 --case 0: num_worst_tokens"):
        F.check_case(F.FuzzCase(**{**bad.__dict__, "kind": "ht", "num_worst_tokens": max(1, sum(bad.tokens)) - 1,
                                   "tokens": tuple(max(t, 1) for t in bad.tokens), "max_tokens": 0,
                                   "hook": False, "zero_copy": False, "round_scale": False, "ue8m0": False,
                                   "repeated": False}))


def test_inputs_follow_the_case(cases):
    """Shapes, dtypes, expert ranges, the ranks a routing leaves idle, holes and LL's repeated ids."""
    seen_repeat = seen_hole = False
    for c in cases[::29] + [c for c in cases if c.repeated][:10]:
        local = c.experts // c.world
        for rank in range(c.world):
            x, idx, w = F.rank_inputs(c, rank)
            T = c.tokens[rank]
            assert x.shape == (T, c.hidden) and x.dtype == torch.bfloat16
            assert idx.shape == w.shape == (T, c.topk) and idx.dtype == torch.int64 and w.dtype == torch.float32
            valid = idx[idx >= 0]
            assert bool(((idx >= -1) & (idx < c.experts)).all())
            assert set((valid // local).tolist()) <= set(c.dest_ranks), (c.repro, c.dest_ranks)
            seen_hole |= bool((idx == -1).any())
            rows = [[e for e in row if e >= 0] for row in idx.tolist()]
            repeats = any(len(r) != len(set(r)) for r in rows)
            assert c.repeated or not repeats, c.repro  # distinct ids unless the case asks for repeats
            seen_repeat |= repeats
    assert seen_hole and seen_repeat


def test_every_dimension_is_covered(cases):
    def values(field):
        return {getattr(c, field) for c in cases}

    assert {(n, per_node) for n in range(1, 5) for per_node in range(1, 5)} <= values("layout")
    tokens = {t for c in cases for t in c.tokens}
    assert {0, 1, F.MAX_TOKENS} <= tokens
    assert any(len(set(c.tokens)) > 1 for c in cases)  # different per rank
    assert min(values("hidden")) == 128 and max(values("hidden")) == 7168
    assert values("topk") == set(range(1, 10))
    assert min(values("experts")) == 8 and max(values("experts")) == 288
    assert values("routing") == set(F.ROUTINGS) and values("kind") == set(F.KINDS)
    assert values("combine_dtype") == set(F.COMBINE_DTYPES) and values("bias") == {0, 1, 2}
    assert values("stream") == set(F.STREAM_MODES) and set(F.ALIGNMENTS) <= values("expert_alignment")
    for kind in F.KINDS:
        mine = [c for c in cases if c.kind == kind]
        assert {c.fault != "" for c in mine} == {True, False}, kind
    ht = [c for c in cases if c.kind == "ht"]
    assert {(c.fp8, c.weights, c.cached, bool(c.num_worst_tokens)) for c in ht} == \
        {(a, b, d, e) for a in (0, 1) for b in (0, 1) for d in (0, 1) for e in (0, 1)}
    em = [c for c in cases if c.kind == "expert_major"]
    assert {bool(c.expert_capacity) for c in em} == {True, False} and {c.cached for c in em} == {True, False}
    assert {c.overflow for c in em if c.expert_capacity} == {"", *F.OVERFLOWS}
    ll = [c for c in cases if c.kind == "ll"]
    for field in ("fp8", "hook", "round_scale", "ue8m0", "zero_copy", "repeated"):
        assert {getattr(c, field) for c in ll} == {True, False}, field
    assert any(c.max_tokens == max(c.tokens) for c in ll) and any(c.max_tokens > max(c.tokens) for c in ll)
    # ranks and nodes that receive nothing
    assert any(len(c.dest_ranks) < c.world for c in cases)
    assert any(c.routing == "idle_node" and c.nodes > 1 for c in cases)


def test_seeds_with_a_bounded_world():
    seeds = F.seeds_with(5, 4)
    assert len(seeds) == 5 and all(F.layout_of(s)[0] * F.layout_of(s)[1] <= 4 for s in seeds)
    assert seeds == sorted(seeds) and seeds == F.seeds_with(5, 4)


@pytest.mark.parametrize("seed", F.seeds_with(2, 4, first=1000))
def test_cases_run_on_cpu_ranks_against_the_reference_and_the_oracle(seed):
    """Every case of the seed on CPU ranks (the reference backend under test): the runner's comparisons and
    the dense oracle pass, and the rows each rank received are what the oracle counts."""
    cases = F.generate(seed)
    got = run_cases(cases, sut="reference", timeout=300)
    assert len(got) == cases[0].world and all(len(per_rank) == len(cases) for per_rank in got)


def test_a_failing_case_names_its_repro_line():
    """A case the reference refuses on one rank (num_worst_tokens below what it receives) fails the spawn with
    the case's repro line and its fields."""
    seed = F.seeds_with(1, 2, first=2000)[0]
    c = next(c for c in F.generate(seed, 32) if c.kind == "ht" and not c.fault and sum(c.tokens) > 1)
    c = F.FuzzCase(**{**c.__dict__, "num_worst_tokens": 1, "fp8": False})
    with pytest.raises(RuntimeError, match=f"scripts/fuzz_gpu.sh --seed {seed} --case {c.index} failed on rank "
                                           r"\d: RuntimeError: dispatch: rank \d received \d+ tokens, more than "
                                           "num_worst_tokens=1"):
        run_cases([c], sut="reference", timeout=120)


def test_the_command_line_refuses_bad_arguments(capsys):
    for argv, why in ((["--case", "1"], "--case needs --seed"), ([], "give --seed S"),
                      (["--seed", "1", "--seeds", "2"], "give --seed S"), (["--seed", "1", "--cases", "0"], "--cases"),
                      (["--seeds", "2", "--gpus", "2"], "--gpus runs seeds side by side on GPUs: not with --cpu"),
                      (["--seeds", "2", "--gpus", "0"], "--gpus must be between 1 and the GPUs here")):
        with pytest.raises(SystemExit) as exc:
            fuzz_main(argv + ["--cpu"])
        assert exc.value.code == 2 and why in capsys.readouterr().err, argv


def test_a_run_reports_each_seed_and_a_summary(capfd):  # capfd: rank 0 is a child process
    """The command line's run loop on CPU ranks: one line per seed (and its rank 0's share of Buffer making),
    then the summary; exit status 0."""
    seed = F.seeds_with(1, 2, first=3000)[0]
    assert fuzz_main(["--seeds", "1", "--first", str(seed), "--cases", "1", "--cpu"]) == 0
    out = capfd.readouterr().out
    n, per_node = F.layout_of(seed)
    assert re.search(rf"seed {seed} rank 0: 1 cases in [\d.]+ s, [\d.]+ s of it making and destroying", out), out
    assert f"seed {seed} ({n}x{per_node}, 1 cases): ok in " in out
    assert f"fuzz: 1 seeds run ({seed}..{seed}), 0 failed, " in out


def test_a_seed_on_one_gpu_names_it_by_uuid(monkeypatch):
    """What a seed's ranks get as CUDA_VISIBLE_DEVICES: the UUID of the parent's i-th visible GPU, whether the
    parent's list names GPUs by index or by UUID (an MPS daemon renumbers indices; UUIDs name one GPU)."""
    from fuzz_runner import visible_gpu_uuid

    smi = "0, GPU-aaa\n1, GPU-bbb\n2, GPU-ccc\n3, GPU-ddd\n"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert [visible_gpu_uuid(i, smi) for i in range(4)] == ["GPU-aaa", "GPU-bbb", "GPU-ccc", "GPU-ddd"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 3")
    assert [visible_gpu_uuid(i, smi) for i in range(2)] == ["GPU-ccc", "GPU-ddd"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-bbb,GPU-ddd")
    assert visible_gpu_uuid(1, smi) == "GPU-ddd"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    with pytest.raises(RuntimeError, match=r"GPU 7 \(visible GPU 0\) is not in nvidia-smi's list"):
        visible_gpu_uuid(0, smi)


def test_seeds_side_by_side_get_disjoint_cores():
    from fuzz_runner import cpu_slices

    slices = cpu_slices({3, 5, 6, 9, 10, 11, 12}, 3)
    assert slices == [{3, 5}, {6, 9}, {10, 11, 12}]
    assert cpu_slices({0, 1}, 1) == [{0, 1}]


def test_ranks_set_the_cores_they_are_given():
    """The cores given reach each rank's sched_setaffinity before its first case (CPU ranks; GPU ranks take
    the same path): a core that does not exist fails every rank there."""
    seed = F.seeds_with(1, 2, first=3000)[0]
    with pytest.raises(RuntimeError, match=r"(?s)ranks \[0, 1\] of 2 failed.*sched_setaffinity\(0, cpus\)"):
        run_cases(F.generate(seed, 1), sut="reference", timeout=120, cpus={1 << 20})


def test_low_latency_repeated_ids_weigh_each_slot_once():
    """A token naming one expert in two slots: the reference's LL combine gives w1 * y + w2 * y, as the native
    kernels and the dense oracle do (it gave 2 (w1 + w2) y before the fuzz suite found it)."""
    c = F.case(3017, 7)
    assert c.kind == "ll" and c.repeated and c.world <= 2
    rows = [[e for e in row if e >= 0] for r in range(c.world) for row in F.rank_routing(c, r).tolist()]
    assert any(len(row) != len(set(row)) for row in rows), "the case has no repeated id"
    assert len(run_cases([c], sut="reference", timeout=120)) == c.world


def test_repeated_ids_keep_every_ll_expert_within_max_tokens_rows_of_a_rank(cases):
    """A repeat is one row more for its expert: past num_max_dispatch_tokens_per_rank the native kernels refuse
    the call (as they must), so the generator makes no such repeat (seed 2 case 2 made 188 rows of 159)."""
    repeated = [c for c in cases if c.repeated] + [F.case(2, 2)]
    capped = 0
    for c in repeated:
        for rank in range(c.world):
            idx = F.rank_routing(c, rank)
            rows = torch.bincount(idx[idx >= 0], minlength=c.experts)
            assert int(rows.max()) <= c.max_tokens, (c.repro, rank, int(rows.max()), c.max_tokens)
            capped += int(rows.max()) == c.max_tokens
    assert capped, "no case reaches the cap: the bound is not exercised"


def test_the_router_drop_keeps_each_experts_first_tokens():
    idx = torch.tensor([[0, 1], [1, -1], [0, 1], [2, 0], [0, 2]])
    assert drop_over_capacity(idx, 4, 2).tolist() == [[0, 1], [1, -1], [0, -1], [2, -1], [-1, 2]]
    assert torch.equal(drop_over_capacity(idx, 4, 4), idx)
    # (source, tokens, local expert, rank): source 0 sends experts 0 and 1 (rank 0's) 4 and 3 tokens
    assert capacity_overflows([idx, idx[:1]], 4, 2) == {(0, 4, 0, 0), (0, 3, 1, 0)}


def test_capacities_below_the_token_count_are_drawn(cases):
    """Capacity layouts below a source's tokens (issues #42 / #47): drop cases whose router dropped selections
    (so blocks fill up to exactly the capacity), error cases that overflow and error cases that fit."""
    below = [c for c in cases if c.kind == "expert_major" and c.expert_capacity and c.expert_capacity < max(c.tokens)]
    assert below and all(c.overflow for c in below)
    dropped = error_over = error_fits = 0
    for c in below:
        routes = [F.rank_routing(c, r) for r in range(c.world)]
        assert not capacity_overflows(routes, c.experts, c.expert_capacity) or c.overflow == "error", c.repro
        if c.overflow == "drop":
            raw = [F.rank_routing(F.FuzzCase(**{**c.__dict__, "overflow": ""}), r) for r in range(c.world)]
            dropped += bool(capacity_overflows(raw, c.experts, c.expert_capacity))
        else:
            error_over += F.overflowing(c)
            error_fits += not F.overflowing(c)
    assert dropped >= 10 and error_over >= 5 and error_fits >= 1, (dropped, error_over, error_fits)


def test_capacity_cases_the_api_would_refuse_are_not_made():
    c = next(c for c in F.generate(F.seeds_overflowing(1, 4)[0]) if F.overflowing(c))
    with pytest.raises(ValueError, match="expert_capacity below a source's rows"):
        F.check_case(F.FuzzCase(**{**c.__dict__, "overflow": ""}))
    with pytest.raises(ValueError, match="overflow error between nodes"):
        assert c.world > 1
        F.check_case(F.FuzzCase(**{**c.__dict__, "nodes": c.world, "ranks_per_node": 1}))


def test_a_capacity_overflow_raises_on_every_rank_on_cpu_ranks():
    """An overflowing case through the reference backend under test: every rank raises the capacity error
    naming a block the oracle says overflows (the runner checks it), so each rank reports 0 rows; the same case
    told it fits fails in the runner, naming the oracle's overflows."""
    seed = F.seeds_overflowing(1, 4)[0]
    c = next(c for c in F.generate(seed) if F.overflowing(c))
    assert run_cases([c], sut="reference", timeout=300) == [[0]] * c.world
    with pytest.raises(RuntimeError, match=f"{c.repro} failed on rank \\d: AssertionError: the generator's routing "
                                           "overflows"):
        run_cases([F.FuzzCase(**{**c.__dict__, "overflow": ""})], sut="reference", timeout=300)


def test_a_dropping_router_fills_capacity_blocks_on_cpu_ranks():
    """A drop case whose router dropped selections: the capacity layout's rows (checked against the dense
    oracle's blocks and combine sums by the runner) are experts x ranks x capacity on every rank."""
    c = next(c for s in F.seeds_with(40, 2) for c in F.generate(s) if c.overflow == "drop" and c.world > 1
             and capacity_overflows([F.rank_routing(F.FuzzCase(**{**c.__dict__, "overflow": ""}), r)
                                     for r in range(c.world)], c.experts, c.expert_capacity))
    rows = c.experts * c.expert_capacity  # local experts x ranks x capacity
    assert run_cases([c], sut="reference", timeout=300) == [[rows]] * c.world


def test_a_failure_report_keeps_every_ranks_error():
    """The report of a failed seed cuts each rank's traceback, not the whole text: the first rank's error (often
    the cause; the others fail because it left) stays in it however long the last rank's traceback is."""
    from fuzz_runner import each_rank_tail

    text = ("ranks [0, 2] of 3 failed:\n--- rank 0 ---\n" + "frame\n" * 2000 + "AssertionError: rank 0's cause\n"
            "--- rank 2 ---\n" + "frame\n" * 2000 + "RuntimeError: connection closed by peer\n")
    report = each_rank_tail(text)
    assert len(report) < 6000
    for part in ("--- rank 0 ---", "rank 0's cause", "--- rank 2 ---", "connection closed by peer"):
        assert part in report, part


def test_combine_tolerance_across_nodes_grows_with_the_partial_sums():
    """A combine across nodes rounds each node's partial sum to the combine dtype (seed 25 case 1: one bf16
    element 0.031 off at 0.2, the partial sums up to ~9): allowed there, not in one node, and not beyond the
    rounding bound."""
    from fuzz_runner import _close

    want = torch.full((2, 4), 0.2).to(torch.bfloat16)
    got = want.clone()
    got[1, 2] += 0.03125
    magnitude = torch.full((2, 4), 9.0)
    _close(got, want, torch.bfloat16, "combine", magnitude)
    with pytest.raises(AssertionError, match="not close"):
        _close(got, want, torch.bfloat16, "combine")  # one node: no partial sums in bf16
    with pytest.raises(AssertionError, match=r"1 of 8 elements off; first at \(1, 2\)"):
        _close(got, want, torch.bfloat16, "combine", torch.full((2, 4), 0.5))
    got[1, 2] = float("nan")
    with pytest.raises(AssertionError, match="1 of 8 elements off"):
        _close(got, want, torch.bfloat16, "combine", magnitude)
    with pytest.raises(AssertionError, match="shape"):
        _close(want[:1], want, torch.bfloat16, "combine", magnitude)
