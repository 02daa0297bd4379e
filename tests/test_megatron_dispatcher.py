"""`--moe-token-dispatcher-type uccl` in megatron-core: parity with alltoall, config checks, arg parsing."""
from __future__ import annotations

import pytest
import torch

from dist_utils import run_ranks
from megatron_utils import build_moe_layer, init_parallel, moe_config


def _layer_parity(rank: int, world: int, device: str, overrides: dict) -> int:
    init_parallel(world)
    results = {}
    for dispatcher in ("alltoall", "uccl"):
        layer = build_moe_layer(dispatcher, **overrides).to(device)
        kind = type(layer.token_dispatcher).__name__
        assert kind == ("UCCLTokenDispatcher" if dispatcher == "uccl" else "MoEAlltoAllTokenDispatcher")
        g = torch.Generator().manual_seed(rank)
        # drop-and-pad needs one token count on every rank (one capacity), as Megatron's alltoall does
        n = 8 if overrides.get("moe_pad_expert_input_to_capacity") else 7 + rank
        x = torch.randn(n, 2, 64, generator=g).to(device).requires_grad_(True)
        out, _ = layer(x)
        (out * torch.arange(out.numel(), device=device).view_as(out).sin()).sum().backward()
        grads = {n: p.grad.detach().clone() for n, p in layer.named_parameters() if p.grad is not None}
        results[dispatcher] = (out.detach(), x.grad.detach(), grads)
    (oa, xa, ga), (ou, xu, gu) = results["alltoall"], results["uccl"]
    torch.testing.assert_close(ou, oa, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(xu, xa, atol=1e-6, rtol=1e-5)
    assert ga.keys() == gu.keys() and len(ga) > 5, "expert, router and shared-expert weights all get gradients"
    for name in ga:
        torch.testing.assert_close(gu[name], ga[name], atol=1e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")
    return len(ga)


@pytest.mark.parametrize("world,overrides", [
    (2, {}),
    (4, {}),
    (2, {"moe_expert_capacity_factor": 0.5}),  # token dropping: dropped slots are -1
    # drop-and-pad: the sync-free path (capacity-padded expert rows)
    (2, {"moe_expert_capacity_factor": 0.5, "moe_pad_expert_input_to_capacity": True}),
    (4, {"moe_expert_capacity_factor": 1.5, "moe_pad_expert_input_to_capacity": True}),
    (2, {"moe_shared_expert_overlap": True}),  # shared expert driven by the dispatcher's hooks
    (2, {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
         "moe_router_load_balancing_type": "seq_aux_loss", "moe_shared_expert_intermediate_size": None}),
])
def test_moe_layer_matches_alltoall(world, overrides):
    counts = run_ranks(_layer_parity, world, overrides)
    assert len(set(counts)) == 1


def _gpt_parity(rank: int, world: int, device: str) -> list[float]:
    import argparse

    from uccl_ep_train.apps.train import train_rank
    args = argparse.Namespace(recipe="tiny", seq_length=32, micro_batch_size=2, lr=3e-3, seed=7, steps=20,
                              quiet=True, log_every=100, num_sms=None)
    curves = {}
    for dispatcher in ("alltoall", "uccl"):
        args.dispatcher = dispatcher
        curves[dispatcher] = [r["loss"] for r in train_rank(rank, world, args, torch.device(device))]
    a, u = curves["alltoall"], curves["uccl"]
    assert a[-1] < a[0], "training must make progress"
    for step, (x, y) in enumerate(zip(a, u)):
        assert abs(x - y) <= 1e-4 * max(1.0, abs(x)), f"step {step + 1}: alltoall {x} vs uccl {y}"
    return u


def test_gpt_loss_curve_matches_alltoall_for_20_steps():
    curves = run_ranks(_gpt_parity, 2, timeout=400)
    assert curves[0] == curves[1]  # the logged loss is the DP mean: identical on every rank


def _config_checks(rank: int, world: int, device: str) -> int:
    init_parallel(world)
    with pytest.raises(ValueError, match="expert tensor parallelism"):
        moe_config("uccl", expert_tensor_parallel_size=2)
    cfg = moe_config("uccl")
    assert cfg.moe_token_dispatcher_type == "uccl"
    return 1


def test_config_time_rejections():
    run_ranks(_config_checks, 2)


def test_megatron_parser_accepts_uccl_and_rejects_typos(capsys):
    import megatron_patch
    megatron_patch.apply()
    megatron_patch.apply()  # idempotent
    import argparse

    from megatron.training.arguments import add_megatron_arguments

    from megatron_patch import settings
    parser = settings.add_arguments(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
    args = parser.parse_args(["--moe-token-dispatcher-type", "uccl", "--uccl-ep-num-sms", "8"])
    assert args.moe_token_dispatcher_type == "uccl" and args.uccl_ep_num_sms == 8
    flex = parser.parse_args(["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "uccl"])
    assert flex.moe_flex_dispatcher_backend == "uccl"
    with pytest.raises(SystemExit):
        parser.parse_args(["--moe-token-dispatcher-type", "ucl"])
    assert "invalid choice: 'ucl'" in capsys.readouterr().err
    settings.apply_arguments(args)
    assert settings.num_sms == 8
    settings.num_sms = None
    with pytest.raises(ValueError, match="--uccl-ep-num-sms must be a positive even number"):
        settings.apply_arguments(argparse.Namespace(uccl_ep_num_sms=7))


def _gpu_parity(rank: int, world: int, device: str, overrides: dict) -> int:
    return _layer_parity(rank, world, device, overrides)


@pytest.mark.gpu
def test_moe_layer_parity_on_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    run_ranks(_gpu_parity, 2, {}, device="cuda")


def _flex_parity(rank: int, world: int, device: str) -> int:
    """Megatron's flex dispatcher, DeepEP backend, with our deep_ep drop-in underneath."""
    init_parallel(world)
    from uccl_ep_train.compat import install_deep_ep
    install_deep_ep()
    outs = {}
    for name, kw in (("alltoall", {}), ("flex", {"moe_flex_dispatcher_backend": "deepep"}),
                     ("flex-uccl", {"moe_flex_dispatcher_backend": "uccl"})):
        layer = build_moe_layer("flex" if name.startswith("flex") else name, **kw).to(device)
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(6, 2, 64, generator=g).to(device).requires_grad_(True)
        out, _ = layer(x)
        out.sum().backward()
        outs[name] = (out.detach(), x.grad.detach())
        if name.startswith("flex"):
            import deep_ep
            from megatron.core.transformer.moe import fused_a2a
            assert fused_a2a.Buffer is deep_ep.Buffer and "uccl_ep_train" in deep_ep.Buffer.__module__
    for name in ("flex", "flex-uccl"):
        torch.testing.assert_close(outs[name][0], outs["alltoall"][0], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(outs[name][1], outs["alltoall"][1], atol=1e-6, rtol=1e-5)
    return 1


def test_flex_deepep_backend_runs_on_our_deep_ep():
    assert run_ranks(_flex_parity, 2) == [1, 1]


def _buffer_growth(rank: int, world: int, device: str) -> int:
    """A later, wider layer grows the shared Buffer; an earlier layer's backward still runs on the old one."""
    import torch.distributed as dist

    from megatron_patch.dispatcher import destroy_buffers, get_buffer
    from uccl_ep_train import autograd as ep_autograd
    group = dist.new_group(list(range(world)))
    small = get_buffer(group, 64)
    x = torch.randn(5, 32, requires_grad=True)
    idx = torch.tensor([[0, 3], [1, -1], [2, 0], [3, 1], [-1, 2]])
    w = torch.rand(5, 2, requires_grad=True)
    recv_x, _, recv_w, _, handle = ep_autograd.dispatch(small, x, idx, w, 4)
    out = ep_autograd.combine(small, recv_x * recv_w.sum(1, keepdim=True), handle)
    big = get_buffer(group, 1 << 20)
    assert big is not small and big.num_nvl_bytes > small.num_nvl_bytes
    out.sum().backward()
    assert x.grad is not None and w.grad is not None
    destroy_buffers()
    with pytest.raises(RuntimeError, match="after destroy"):
        small.combine(recv_x.detach(), handle)
    return 1


def test_growing_the_shared_buffer_keeps_earlier_graphs_alive():
    assert run_ranks(_buffer_growth, 2) == [1, 1]


@pytest.mark.gpu
def test_flex_deepep_backend_on_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    assert run_ranks(_flex_parity, 2, device="cuda") == [1, 1]



def _layer_run(rank: int, world: int, device: str, kind: str) -> tuple:
    """One MoE layer forward + backward with the `uccl` dispatcher, or the `flex` one on our deep_ep drop-in;
    (output, input grad, parameter grads) on CPU, and the backends its Buffers ran on."""
    init_parallel(world)
    from megatron_patch.dispatcher import _buffers, destroy_buffers
    kw = {}
    if kind == "flex":
        from uccl_ep_train.compat import install_deep_ep
        install_deep_ep()
        kw = {"moe_flex_dispatcher_backend": "deepep"}
    layer = build_moe_layer(kind, **kw).to(device)
    weights = torch.Generator().manual_seed(1234)  # the same weights whatever device Megatron initialised on
    with torch.no_grad():
        for _, p in sorted(layer.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=weights).mul_(0.1))
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(7 + rank, 2, 64, generator=g).to(device).requires_grad_(True)
    out, _ = layer(x)
    (out * torch.arange(out.numel(), device=device).view_as(out).sin()).sum().backward()
    buffers = list(_buffers.values())
    if kind == "flex":
        from megatron.core.transformer.moe import fused_a2a
        buffers = [fused_a2a._buffer]
    backends = sorted({type(b.backend).__name__ for b in buffers})
    host = lambda t: t.detach().cpu().numpy()  # noqa: E731 - numpy crosses the result queue by value
    grads = {n: host(p.grad) for n, p in layer.named_parameters() if p.grad is not None}
    result = (host(out), host(x.grad), grads, backends)
    destroy_buffers()
    if kind == "flex":  # Megatron's module-level Buffer, not one of the uccl dispatcher's
        buffers[0].destroy()
    return result


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["uccl", "flex"])
def test_moe_layer_on_two_emulated_nodes_matches_the_reference(mps, kind):
    """2 nodes x 2 ranks on one GPU (MPS): the uccl dispatcher, and Megatron's flex dispatcher on our deep_ep
    drop-in, on the native internode backend (NVLink inside a node, CPU proxies between nodes) give the
    outputs and gradients of the same dispatcher on the reference backend on CPU ranks."""
    from uccl_ep_train.backends.internode import internode_available
    if not internode_available():
        pytest.skip("native module without the internode path")
    env = {"UCCL_EP_RANKS_PER_NODE": "2"}
    ref = run_ranks(_layer_run, 4, kind, env={**env, "CUDA_VISIBLE_DEVICES": ""})  # Megatron on CPU only
    got = run_ranks(_layer_run, 4, kind, device="cuda", backend="gloo", ranks_per_gpu=4, env=env, timeout=400)
    close = lambda a, b, what: torch.testing.assert_close(  # noqa: E731
        torch.from_numpy(a), torch.from_numpy(b), atol=1e-5, rtol=1e-4, msg=lambda m: f"{what}: {m}")
    for rank, ((o, xg, gr, b), (eo, exg, egr, eb)) in enumerate(zip(got, ref)):
        assert b == ["NativeInternodeBackend"] and eb == ["ReferenceBackend"], (rank, b, eb)
        close(o, eo, f"rank {rank} output")
        close(xg, exg, f"rank {rank} input grad")
        assert gr.keys() == egr.keys() and len(gr) > 5
        for name in gr:
            close(gr[name], egr[name], f"rank {rank} {name}")


def _drop_and_pad_graph(rank: int, world: int, device: str) -> list:
    """Megatron's MoELayer with the uccl dispatcher's drop-and-pad path (the expert-major pair in a capacity
    layout: no host sync) captured once in a CUDA graph and replayed 100 times, each replay bit-equal to eager."""
    from megatron_utils import replay_forward_exactly
    init_parallel(world)
    dev = torch.device("cuda", torch.cuda.current_device())
    layer = build_moe_layer("uccl", moe_expert_capacity_factor=1.5, moe_pad_expert_input_to_capacity=True,
                            moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                            moe_shared_expert_intermediate_size=None).to(dev)
    replay_forward_exactly(layer, rank, (8, 2, 64), 100)
    from megatron_patch.dispatcher import _buffers, destroy_buffers
    backends = sorted({type(b.backend).__name__ for b in _buffers.values()})
    destroy_buffers()
    return backends


@pytest.mark.gpu
@pytest.mark.parametrize("nodes", [1, 2], ids=["1x2", "2x2"])
def test_drop_and_pad_layer_replays_a_cuda_graph_exactly(mps, nodes):
    """On one node (native intranode backend) and on 2 emulated nodes x 2 ranks (native internode backend:
    its op counters live on the GPU, so replays and eager calls stay in step across nodes)."""
    from dist_utils import gpu_ranks
    from uccl_ep_train.backends.internode import internode_available
    if nodes > 1 and not internode_available():
        pytest.skip("native module without the internode path")
    world = 2 * nodes
    got = run_ranks(_drop_and_pad_graph, world, env={"UCCL_EP_RANKS_PER_NODE": "2", "UCCL_EP_BACKEND": "native"},
                    timeout=400, **gpu_ranks(world))
    want = "NativeInternodeBackend" if nodes > 1 else "NativeBackend"
    assert got == [[want]] * world, got


def test_expert_major_paths_are_logged_once_per_answer(caplog, monkeypatch):
    """The dispatcher says (rank 0) how the backend ran the expert-major calls, again only when that changes."""
    import logging
    import types

    from megatron_patch import dispatcher

    monkeypatch.setattr(dispatcher, "_logged_paths", set())
    buf = types.SimpleNamespace(rank=0, backend_name="native", expert_major_paths={})
    with caplog.at_level(logging.INFO, logger="uccl_ep_train"):
        dispatcher._log_expert_major_paths(buf)  # no call yet: nothing to say
        buf.expert_major_paths = {"dispatch_expert_major": "fused", "combine_expert_major": "permute"}
        dispatcher._log_expert_major_paths(buf)
        dispatcher._log_expert_major_paths(buf)
        buf.expert_major_paths = {**buf.expert_major_paths, "dispatch_expert_major_cached": "side_blocks"}
        dispatcher._log_expert_major_paths(buf)
    said = [r.getMessage() for r in caplog.records if "expert-major calls" in r.getMessage()]
    assert said == ["uccl dispatcher: expert-major calls on the native backend: combine_expert_major permute, "
                    "dispatch_expert_major fused",
                    "uccl dispatcher: expert-major calls on the native backend: combine_expert_major permute, "
                    "dispatch_expert_major fused, dispatch_expert_major_cached side_blocks"]
