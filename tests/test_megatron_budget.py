"""The uccl dispatcher under Megatron-LM main's dispatcher contract: the receive budget
(`moe_expert_rank_capacity_factor`: static / eager), the paged-stash hooks (an overflow reported, the step
replayed without the budget bit-equal to a dropless run, the budget grown), `moe_flex_dispatcher_num_sms`.

Runs against the installed megatron-core (0.19, which has the config fields but not every hook), and, when
MEGATRON_LM_MAIN names a Megatron-LM checkout (main at d98e8a6 or later: its megatron/ is put first on the
ranks' sys.path), against that tree's megatron.core too; skipped without it.
"""
from __future__ import annotations

import os
import sys
import types
from typing import Optional

import pytest
import torch

from dist_utils import run_ranks

MAIN_ENV = "MEGATRON_LM_MAIN"
HOOKS = ("check_over_budget", "check_required_capacity", "reset_over_budget", "grow_ep_recv_capacity",
         "invalidate_ep_bootstrap")


def _main_tree() -> Optional[str]:
    path = os.environ.get(MAIN_ENV)
    if not path:
        return None
    if not os.path.isfile(os.path.join(path, "megatron", "core", "transformer", "moe", "paged_stash.py")):
        pytest.fail(f"{MAIN_ENV}={path}: not a Megatron-LM checkout with megatron/core/transformer/moe/paged_stash.py")
    return path


TREES = [pytest.param(None, id="installed"),
         pytest.param("main", id="megatron-lm-main",
                      marks=pytest.mark.skipif(not os.environ.get(MAIN_ENV), reason=f"set {MAIN_ENV} to a checkout"))]


def _use_tree(tree: Optional[str]) -> None:
    """In a rank: import megatron from the Megatron-LM checkout (before anything imports it)."""
    if tree is None:
        return
    assert "megatron" not in sys.modules, "megatron was imported before the tree was chosen"
    sys.path.insert(0, tree)
    import megatron.core
    assert os.path.abspath(megatron.core.__file__).startswith(os.path.abspath(tree)), megatron.core.__file__


def _tree_arg(tree):
    return _main_tree() if tree == "main" else None


def _run(layer, x: torch.Tensor):
    """One forward + backward; (output, input grad, parameter grads), grads cleared after."""
    x = x.clone().requires_grad_(True)
    out, _ = layer(x)
    (out * torch.arange(out.numel(), dtype=out.dtype).view_as(out).cos()).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in layer.named_parameters() if p.grad is not None}
    layer.zero_grad(set_to_none=True)
    return out.detach(), x.grad.detach(), grads


def _assert_same(a, b, exact: bool) -> None:
    for ta, tb in ((a[0], b[0]), (a[1], b[1])):
        if exact:
            assert torch.equal(ta, tb)
        else:
            torch.testing.assert_close(ta, tb, atol=1e-6, rtol=1e-5)
    assert a[2].keys() == b[2].keys() and len(a[2]) > 3
    for name in a[2]:
        if exact:
            assert torch.equal(a[2][name], b[2][name]), name
        else:
            torch.testing.assert_close(a[2][name], b[2][name], atol=1e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")


def _all_ranks_sum(flag: torch.Tensor) -> int:
    t = flag.to(torch.int64).reshape(1).clone()
    torch.distributed.all_reduce(t)
    return int(t.item())


def _budget_replay(rank: int, world: int, device: str, tree: Optional[str]) -> dict:
    _use_tree(tree)
    from megatron_utils import build_moe_layer, init_parallel
    init_parallel(world)
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(8, 2, 64, generator=g)  # 16 tokens per rank, the same count on every rank
    overrides = dict(moe_shared_expert_intermediate_size=None)
    alltoall = _run(build_moe_layer("alltoall", **overrides), x)
    eager_layer = build_moe_layer("uccl", **overrides)
    assert eager_layer.token_dispatcher.check_over_budget() is None  # nothing dispatched yet
    eager = _run(eager_layer, x)
    d = eager_layer.token_dispatcher
    assert d._comm_manager.capacity is None and not bool(d.check_over_budget())
    assert int(d.check_required_capacity()) == 0
    _assert_same(eager, alltoall, exact=False)

    # static, a budget far below the routing's need: overflow reported on the device, selections dropped
    # (16 tokens x top-3 over 8 experts: ~6 per expert and rank; a 0.2 budget gives blocks of 2 rows)
    layer = build_moe_layer("uccl", moe_expert_rank_capacity_factor=0.2, **overrides)
    d = layer.token_dispatcher
    budget = d._comm_manager
    tight = _run(layer, x)
    assert budget.static and budget.capacity >= 1
    assert budget._recv_capacity == budget.capacity * d.num_local_experts * world
    assert _all_ranks_sum(d.check_over_budget()) > 0, "a 0.2 budget with skewed routing must overflow"
    required = d.check_required_capacity().clone()
    torch.distributed.all_reduce(required, op=torch.distributed.ReduceOp.MAX)  # as paged_stash does
    required = int(required.item())
    assert required > budget._recv_capacity
    rows = tight[0]

    # paged_stash.prepare_for_rerun: eager, flags cleared, re-bootstrap, budget grown to the need
    budget.moe_expert_rank_capacity_factor = None
    d.reset_over_budget()
    d.invalidate_ep_bootstrap()
    d.grow_ep_recv_capacity(required)
    replay = _run(layer, x)
    assert not budget.static and not bool(d.check_over_budget())
    # the dropless reference: the same weights through the eager path of a fresh dispatcher, and alltoall
    ref_layer = build_moe_layer("uccl", **overrides)
    ref_layer.load_state_dict(layer.state_dict())
    dropless = _run(ref_layer, x)
    _assert_same(replay, dropless, exact=True)
    ref_a2a = build_moe_layer("alltoall", **overrides)
    ref_a2a.load_state_dict(layer.state_dict())
    _assert_same(replay, _run(ref_a2a, x), exact=False)
    assert not torch.equal(rows, replay[0]), "the tight step dropped selections: its output differs"

    # the step after: factor restored, re-bootstrapped: static again, with the grown budget: no overflow
    budget.moe_expert_rank_capacity_factor = layer.config.moe_expert_rank_capacity_factor
    d.invalidate_ep_bootstrap()
    d.reset_over_budget()
    grown = _run(layer, x)
    assert budget.static and budget._recv_capacity >= required
    assert _all_ranks_sum(d.check_over_budget()) == 0
    _assert_same(grown, dropless, exact=False)  # static vs eager: the same values
    with pytest.raises(ValueError, match="only grows"):
        d.grow_ep_recv_capacity(required)
    return {"required": required, "capacity": budget.capacity}


@pytest.mark.parametrize("tree", TREES)
@pytest.mark.parametrize("world", [2, 4])
def test_overflow_reported_replayed_dropless_and_grown(world, tree):
    got = run_ranks(_budget_replay, world, _tree_arg(tree), timeout=300)
    assert len({r["required"] for r in got}) == 1 and len({r["capacity"] for r in got}) == 1


def _static_parity(rank: int, world: int, device: str, tree: Optional[str]) -> int:
    """A budget that fits: the static layout gives alltoall's values, with no overflow and no counts."""
    _use_tree(tree)
    from megatron_utils import build_moe_layer, init_parallel
    init_parallel(world)
    x = torch.randn(6, 2, 64, generator=torch.Generator().manual_seed(rank))
    a2a = _run(build_moe_layer("alltoall"), x)
    layer = build_moe_layer("uccl", moe_expert_rank_capacity_factor=8.0)
    static = _run(layer, x)
    d = layer.token_dispatcher
    assert d._comm_manager.static and not bool(d.check_over_budget())
    _assert_same(static, a2a, exact=False)
    return d._comm_manager.capacity


@pytest.mark.parametrize("tree", TREES)
@pytest.mark.parametrize("world", [2, 4])
def test_static_budget_matches_alltoall(world, tree):
    assert len(set(run_ranks(_static_parity, world, _tree_arg(tree)))) == 1


def _config_contract(rank: int, world: int, device: str, tree: Optional[str]) -> list:
    _use_tree(tree)
    from megatron_utils import build_moe_layer, init_parallel, moe_config
    from uccl_ep_train import Buffer
    init_parallel(world)
    cfg = moe_config("uccl", moe_expert_rank_capacity_factor=1.5, moe_paged_stash=True)
    assert cfg.moe_expert_rank_capacity_factor == 1.5 and cfg.moe_paged_stash  # restored after Megatron's checks
    with pytest.raises(ValueError, match="moe_expert_rank_capacity_factor must be a positive number"):
        moe_config("uccl", moe_expert_rank_capacity_factor=0.0)
    with pytest.raises(ValueError, match="set one of them"):
        moe_config("uccl", moe_expert_rank_capacity_factor=1.0, moe_expert_capacity_factor=1.0,
                   moe_pad_expert_input_to_capacity=True)
    with pytest.raises(ValueError, match="moe_paged_stash requires moe_expert_rank_capacity_factor"):
        moe_config("uccl", moe_paged_stash=True)
    with pytest.raises(ValueError, match="moe_flex_dispatcher_num_sms must be a positive even number"):
        moe_config("uccl", moe_flex_dispatcher_num_sms=7)
    with pytest.raises(ValueError, match="use moe_token_dispatcher_type='uccl'"):
        moe_config("flex", moe_flex_dispatcher_backend="uccl", moe_expert_rank_capacity_factor=1.0)
    # moe_flex_dispatcher_num_sms: the uccl kernels' SMs when --uccl-ep-num-sms is not given
    build_moe_layer("uccl", moe_flex_dispatcher_num_sms=24)
    assert Buffer.num_sms == 24
    hooks_of_main = []
    if tree is not None:  # every hook main's flex dispatcher offers, ours offers too
        from megatron.core.transformer.moe.token_dispatcher import MoEFlexTokenDispatcher, MoETokenDispatcher

        from megatron_patch.dispatcher import UCCLTokenDispatcher
        hooks_of_main = sorted(n for n in vars(MoEFlexTokenDispatcher)
                               if not n.startswith("_") and callable(getattr(MoEFlexTokenDispatcher, n))
                               and not hasattr(MoETokenDispatcher, n))
        missing = [n for n in hooks_of_main if not hasattr(UCCLTokenDispatcher, n)]
        assert not missing, f"Megatron-LM main's flex dispatcher has {missing}; UCCLTokenDispatcher lacks them"
        assert set(HOOKS) <= set(hooks_of_main)
    return hooks_of_main


@pytest.mark.parametrize("tree", TREES)
def test_config_fields_and_hooks_contract(tree):
    got = run_ranks(_config_contract, 2, _tree_arg(tree))
    if tree is not None:
        assert set(HOOKS) <= set(got[0])


def test_budget_without_main_fields_is_eager():
    """A config from a megatron-core without the field (getattr): eager, the hooks answer, grow is a no-op."""
    from megatron_patch.budget import RecvBudget
    cfg = types.SimpleNamespace()  # no moe_expert_rank_capacity_factor at all
    b = RecvBudget(cfg, num_local_experts=2, ep_size=1, router_topk=2, group=None)
    b.bootstrap(5, torch.device("cpu"))
    assert not b.static and b.over_budget is not None and not bool(b.over_budget)
    routing = torch.ones(5, 2, dtype=torch.bool)
    assert b.limit(routing) is routing
    b.grow_recv_capacity(100)
    assert b._recv_capacity_override is None


def _flex_on_main(rank: int, world: int, device: str, tree: str) -> int:
    """Megatron-LM main's flex dispatcher with backend 'uccl' (its DeepEP manager over our deep_ep) and
    moe_flex_dispatcher_num_sms: alltoall's values, our Buffer underneath with the SM count asked for."""
    _use_tree(tree)
    from megatron_utils import build_moe_layer, init_parallel
    init_parallel(world)
    from uccl_ep_train.compat import install_deep_ep
    install_deep_ep()
    import deep_ep
    x = torch.randn(6, 2, 64, generator=torch.Generator().manual_seed(rank))
    a2a = _run(build_moe_layer("alltoall"), x)
    layer = build_moe_layer("flex", moe_flex_dispatcher_backend="uccl", moe_flex_dispatcher_num_sms=12)
    assert layer.config.moe_flex_dispatcher_backend == "uccl"
    flex = _run(layer, x)
    assert deep_ep.Buffer.num_sms == 12
    assert layer.token_dispatcher.check_over_budget() is None  # the DeepEP manager keeps no budget
    _assert_same(flex, a2a, exact=False)
    return 1


@pytest.mark.skipif(not os.environ.get(MAIN_ENV), reason=f"set {MAIN_ENV} to a checkout")
def test_flex_uccl_backend_on_megatron_lm_main():
    run_ranks(_flex_on_main, 2, _main_tree())


def _budget_graph(rank: int, world: int, device: str) -> int:
    """The static receive budget through Megatron's MoELayer (forward), captured once in a CUDA graph and
    replayed with new inputs: each replay equals the same step run eagerly; no overflow at a budget that fits."""
    from megatron_utils import build_moe_layer, init_parallel, replay_forward_exactly
    init_parallel(world)
    dev = torch.device("cuda", torch.cuda.current_device())
    layer = build_moe_layer("uccl", moe_expert_rank_capacity_factor=4.0, moe_router_load_balancing_type="none",
                            moe_aux_loss_coeff=0.0, moe_shared_expert_intermediate_size=None).to(dev)
    replay_forward_exactly(layer, rank, (16, 2, 64), 20)  # (the warm-up's first dispatch bootstraps the budget)
    d = layer.token_dispatcher
    assert d._comm_manager.static
    assert not bool(d.check_over_budget()), "a 4.0 budget fits this routing"
    from megatron_patch.dispatcher import destroy_buffers
    destroy_buffers()
    return 1


@pytest.mark.gpu
def test_static_budget_captured_in_a_cuda_graph(mps):
    from dist_utils import gpu_ranks
    assert run_ranks(_budget_graph, 2, timeout=600, env={"UCCL_EP_BACKEND": "native"}, **gpu_ranks(2)) == [1, 1]


def _paged_stash_runner(rank: int, world: int, device: str, tree: str) -> dict:
    """Megatron-LM main's own PagedStashRunner.check_moe_overflow / prepare_for_rerun on a uccl MoE layer:
    it sees the overflow, learns the capacity needed and the factor that fits, sends the dispatcher eager
    for a replay that equals a dropless run, and its success path (factor back, re-bootstrap) then runs
    static with the grown budget, without overflow."""
    _use_tree(tree)
    from megatron_utils import build_moe_layer, init_parallel
    init_parallel(world)
    from megatron.core.transformer.moe import paged_stash as ps
    # main makes its "no stash overflow / spill" flags with device='cuda'; on CPU ranks the same flags on the CPU
    ps.check_paged_stash_overflow = lambda: torch.zeros(1, dtype=torch.bool)
    ps.check_paged_stash_host_spill = lambda: torch.zeros(1, dtype=torch.bool)
    overrides = dict(moe_shared_expert_intermediate_size=None)
    x = torch.randn(8, 2, 64, generator=torch.Generator().manual_seed(200 + rank))
    layer = build_moe_layer("uccl", moe_expert_rank_capacity_factor=0.2, **overrides)
    # the runner's __init__ walks GPT model chunks; the two methods under test read only these fields
    runner = object.__new__(ps.PagedStashRunner)
    runner.stash_manager = ps.PagedStashManager.get_instance()
    runner.moe_layers = [layer]
    runner._required_recv_capacity = runner._required_capacity_factor = None
    runner._configs_to_sync_moe_paged_stash = []
    runner.model = [types.SimpleNamespace(zero_grad_buffer=lambda: None)]
    runner.optimizer, runner.copy_main_params, runner.forward_backward_func = None, False, None

    d = layer.token_dispatcher
    _run(layer, x)
    _, over_ranks, _ = runner.check_moe_overflow()
    assert over_ranks > 0, "main's runner sees the overflow"
    required, factor = runner._required_recv_capacity, runner._required_capacity_factor
    assert required > d._comm_manager._recv_capacity and factor is not None and factor > 0.2
    runner.prepare_for_rerun(is_training=True)
    replay = _run(layer, x)
    assert not d._comm_manager.static
    assert runner.check_moe_overflow()[1] == 0
    ref = build_moe_layer("uccl", **overrides)
    ref.load_state_dict(layer.state_dict())
    dropless = _run(ref, x)
    _assert_same(replay, dropless, exact=True)
    # PagedStashRunner.__call__'s success path after a rerun
    d._comm_manager.moe_expert_rank_capacity_factor = d.config.moe_expert_rank_capacity_factor
    d.invalidate_ep_bootstrap()
    grown = _run(layer, x)
    assert d._comm_manager.static and d._comm_manager._recv_capacity >= required
    assert runner.check_moe_overflow()[1] == 0
    _assert_same(grown, dropless, exact=False)
    # the factor main suggests fits on its own too
    fitted = build_moe_layer("uccl", moe_expert_rank_capacity_factor=factor, **overrides)
    fitted.load_state_dict(layer.state_dict())
    _run(fitted, x)
    assert runner.moe_layers and _all_ranks_sum(fitted.token_dispatcher.check_over_budget()) == 0
    return {"required": required}


@pytest.mark.skipif(not os.environ.get(MAIN_ENV), reason=f"set {MAIN_ENV} to a checkout")
@pytest.mark.parametrize("world", [2, 4])
def test_megatron_lm_main_paged_stash_runner_replays(world):
    got = run_ranks(_paged_stash_runner, world, _main_tree(), timeout=300)
    assert len({r["required"] for r in got}) == 1


PARSER_PROBE = '''
import argparse, os, sys, megatron.core, megatron_patch
assert os.path.abspath(megatron.core.__file__).startswith(os.path.abspath(sys.argv[1])), megatron.core.__file__
megatron_patch.apply()
from megatron.training.arguments import add_megatron_arguments
from megatron_patch import settings
parser = settings.add_arguments(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
a = parser.parse_args(["--moe-token-dispatcher-type", "uccl", "--moe-expert-rank-capacity-factor", "1.5",
                       "--moe-flex-dispatcher-num-sms", "24"])
b = parser.parse_args(["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "uccl"])
print(a.moe_token_dispatcher_type, a.moe_expert_rank_capacity_factor, a.moe_flex_dispatcher_num_sms,
      b.moe_flex_dispatcher_backend)
'''


@pytest.mark.skipif(not os.environ.get(MAIN_ENV), reason=f"set {MAIN_ENV} to a checkout")
def test_megatron_lm_main_parser_takes_uccl_and_main_fields(tmp_path):
    """Megatron-LM main's argument parser (megatron.training) accepts uccl as dispatcher type and flex
    backend, next to main's budget and SM flags, once the patch is applied."""
    import subprocess
    tree = _main_tree()
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree, repo]))
    r = subprocess.run([sys.executable, "-c", PARSER_PROBE, tree], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["uccl", "1.5", "24", "uccl"]
