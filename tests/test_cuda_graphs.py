"""CUDA graphs on the native backends: a whole MoE layer -- router, dispatch with num_worst_tokens, experts,
combine, and the backward through the autograd pair -- captured once and replayed 100 times with new inputs,
each replay exactly equal to the same step run eagerly right after it (so graph replays and eager calls also
alternate on the same buffers and stay in step with the peers). Before the kernels read their signal base
(one node) or their op counters (across nodes) from GPU memory, the second replay reused the first one's
numbers and waited on stale signals. The layer runs with the receive-order dispatch and with the expert-major
dispatch in a capacity layout (num_worst_tokens + expert_capacity: the Megatron dispatcher's drop-and-pad
path), on one node of 2 ranks and on 2 emulated nodes x 2 ranks (UCCL_EP_RANKS_PER_NODE; the bytes between
nodes go through the CPU proxies).

Also: the GPU's own value checks (the host's are opt-in with UCCL_EP_CHECK_VALUES=1) end in a clear error on
every rank. Several ranks on one GPU under MPS (the `mps` fixture) when there are fewer GPUs than ranks."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dist_utils import gpu_ranks, run_ranks
from uccl_ep_train import Buffer, permute
from uccl_ep_train import autograd as ep_autograd

pytestmark = pytest.mark.gpu

N, H, E, K = 96, 256, 8, 2  # tokens per rank, hidden, experts, top-k


class MoELayer:
    """Router (linear, top-k of a softmax), dispatch, one linear expert per local expert applied to the rows
    that chose it (scaled by their routing weight), combine. Every size is fixed: the dispatch receives
    num_worst_tokens = ranks * N rows (padding rows have expert id -1 and weight 0)."""

    def __init__(self, buf: Buffer, rank: int, world: int, device: torch.device, expert_major: bool) -> None:
        gen = torch.Generator(device="cpu").manual_seed(100 + rank)
        self.buf, self.world, self.epr, self.expert_major = buf, world, E // world, expert_major
        self.router = (torch.randn(H, E, generator=gen) / H ** 0.5).to(device).requires_grad_()
        self.experts = (torch.randn(self.epr, H, H, generator=gen) / H ** 0.5).to(device).requires_grad_()
        self.grad_out = torch.randn(N, H, generator=gen).to(device)

    def step(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Forward and backward: (output, d x, d router, d experts, per-expert counts)."""
        x = x.detach().requires_grad_()
        probs = torch.softmax(x.float() @ self.router, dim=-1)
        weights, topk_idx = torch.topk(probs, K, dim=-1)
        if self.expert_major:
            return self._expert_major_step(x, topk_idx, weights)
        recv_x, recv_idx, recv_w, _, handle = ep_autograd.dispatch(
            self.buf, x, topk_idx, weights, E, num_worst_tokens=self.world * N)
        y = torch.zeros(recv_x.shape, dtype=torch.float32, device=x.device)
        for e in range(self.epr):
            coeff = torch.where(recv_idx == e, recv_w, 0.0).sum(dim=1, keepdim=True)
            y = y + coeff * (recv_x.float() @ self.experts[e])
        out = ep_autograd.combine(self.buf, y.to(torch.bfloat16), handle)
        return self._grads(out, x, recv_idx)

    def _expert_major_step(self, x, topk_idx, weights):
        """Rows land expert-major in blocks of N rows per (local expert, source rank): a source sends an
        expert at most its N tokens, so the capacity never overflows; every size is fixed."""
        x_em, recv_idx, recv_w, counts, em_map, handle = ep_autograd.dispatch_expert_major(
            self.buf, x, topk_idx, weights, E, num_worst_tokens=self.world * N, expert_capacity=N)
        probs = permute.expand_probs(recv_w, em_map, sum(counts), padded=True)
        rows = self.world * N
        y_em = torch.cat([x_em[e * rows:(e + 1) * rows].float() @ self.experts[e] for e in range(self.epr)])
        y_em = (y_em * probs[:, None]).to(torch.bfloat16)
        out = ep_autograd.combine_expert_major(self.buf, y_em, handle, em_map, expert_capacity=N)
        return self._grads(out, x, recv_idx)

    def _grads(self, out, x, recv_idx):
        """(output, d x, d router, d experts, the received slots per local expert counted on the GPU)."""
        grads = torch.autograd.grad((out.float() * self.grad_out).sum(), [x, self.router, self.experts])
        return (out.detach(), *grads, permute.tokens_per_expert(recv_idx, self.epr))


def _replays(rank: int, world: int, device: str, expert_major: bool) -> int:
    dev = torch.device("cuda", torch.cuda.current_device())
    buf = Buffer(dist.new_group(list(range(world))), num_nvl_bytes=64 << 20)
    assert buf.backend_name == "native"
    layer = MoELayer(buf, rank, world, dev, expert_major)
    gen = torch.Generator(device="cpu").manual_seed(rank)
    static_x = torch.randn(N, H, generator=gen).to(dev, torch.bfloat16)
    side = torch.cuda.Stream()  # warm-up off the default stream, as torch.cuda.graph wants
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            layer.step(static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = layer.step(static_x)
    moved = 0
    for i in range(100):
        static_x.copy_(torch.randn(N, H, generator=gen).to(dev, torch.bfloat16))
        graph.replay()
        eager = layer.step(static_x)
        for name, got, want in zip(("out", "d x", "d router", "d experts", "counts"), static_out, eager):
            if not torch.equal(got, want):
                raise AssertionError(f"rank {rank}, replay {i}: {name} differs from eager mode by "
                                     f"{(got.float() - want.float()).abs().max().item()}")
        moved += int(static_out[1].abs().sum().item() > 0)
    buf.check_errors()
    assert moved == 100, "a backward moved no gradient back to x"
    buf.destroy()
    return 1


@pytest.mark.parametrize("nodes", [1, 2], ids=["1x2", "2x2"])
@pytest.mark.parametrize("expert_major", [False, True], ids=["receive-order", "expert-major-capacity"])
def test_moe_layer_forward_and_backward_replay_exactly(mps, expert_major, nodes):
    if nodes > 1:
        from uccl_ep_train.backends.internode import internode_available
        if not internode_available():
            pytest.skip("native module without the internode kernels / proxies")
    world = 2 * nodes
    env = {"UCCL_EP_BACKEND": "native", "UCCL_EP_RANKS_PER_NODE": "2"}
    assert run_ranks(_replays, world, expert_major, timeout=600, env=env, **gpu_ranks(world)) == [1] * world


def _device_value_checks(rank: int, world: int, device: str) -> list[str]:
    """Each bad call on a fresh Buffer (an error leaves a native Buffer unusable): what each rank raised."""
    group = dist.new_group(list(range(world)))
    dev = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(N, H, device=dev).to(torch.bfloat16)
    idx = torch.randint(0, E, (N, K), device=dev)
    seen = []

    def expect(pattern: str, call) -> None:
        buf = Buffer(group, num_nvl_bytes=64 << 20)
        assert buf.backend_name == "native"
        with pytest.raises(RuntimeError, match=pattern) as info:
            call(buf)
            torch.cuda.synchronize()
            buf.check_errors()  # the calls without a host sync: the error is there once the GPU is done
        seen.append(str(info.value))
        buf.destroy()

    def layout(buf, ids):
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(ids, E)
        return dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)

    bad_idx = idx.clone()
    bad_idx[5, 1] = E + 3 if rank == 0 else bad_idx[5, 1]  # only rank 0's routing is wrong
    expect(r"topk_idx\[5, 1\] = 11 is outside \[-1, 8\) on rank 0: expert ids are -1",
           lambda buf: buf.dispatch(x, topk_idx=bad_idx, **layout(buf, bad_idx)))

    def wrong_counts(buf):
        lay = layout(buf, idx)
        buf.dispatch(x, topk_idx=idx, **{**lay, "num_tokens_per_rank": lay["num_tokens_per_rank"] + 1})
    expect(r"dispatch on rank \d: num_tokens_per_rank\[\d\] = \d+ but is_token_in_rank sends \d+ tokens to rank "
           r"\d", wrong_counts)

    wide = torch.randn(N, 2 * H if rank == 1 else H, device=dev).to(torch.bfloat16)
    expect(r"dispatch: ranks disagree on x row bytes: rank \d=\d+, rank \d=\d+",
           lambda buf: buf.dispatch(wide, topk_idx=idx, num_worst_tokens=world * N, **layout(buf, idx)))
    # N * K / E = 24 tokens per expert on average: a capacity of 1 overflows on every rank
    expect(r"dispatch_expert_major: rank \d sends \d+ tokens to local expert \d+ of rank \d, more than "
           r"expert_capacity=1",
           lambda buf: buf.dispatch_expert_major(x, idx, None, E, num_worst_tokens=world * N, expert_capacity=1))
    # ranks that disagree on the capacity (each would place rows in other blocks)
    expect(r"dispatch: ranks disagree on expert_capacity: rank \d=\d+, rank \d=\d+",
           lambda buf: buf.dispatch_expert_major(x, idx, None, E, num_worst_tokens=world * N,
                                                 expert_capacity=N + rank))
    return seen


def test_gpu_value_checks_raise_on_every_rank(mps, monkeypatch):
    monkeypatch.delenv("UCCL_EP_CHECK_VALUES", raising=False)
    per_rank = run_ranks(_device_value_checks, 2, timeout=300,
                         env={"UCCL_EP_BACKEND": "native", "UCCL_EP_TIMEOUT_S": "20"}, **gpu_ranks(2))
    # rank 1 did nothing wrong in the first case: it raises rank 0's error, saying whose it is
    assert "[rank 0 reported it; rank 1 stopped with it]" in per_rank[1][0]


def _internode_capture_refusals(rank: int, world: int, device: str) -> int:
    """A warmed-up internode Buffer: a captured call that would grow the buffers (collective) is refused on every
    rank before any kernel is captured, naming the sizes; the same call then runs outside capture."""
    dev = torch.device("cuda", torch.cuda.current_device())
    buf = Buffer(dist.new_group(list(range(world))), num_nvl_bytes=0, num_rdma_bytes=0)
    assert type(buf.backend).__name__ == "NativeInternodeBackend"

    def inputs(tokens: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:  # made outside capture (host copies)
        gen = torch.Generator(device="cpu").manual_seed(rank + tokens)
        x = torch.randn(tokens, hidden, generator=gen).to(dev, torch.bfloat16)
        return x, torch.randint(0, E, (tokens, K), generator=gen).to(dev)

    def step(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        per_rank, per_node, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        return buf.dispatch(x, topk_idx=idx, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node,
                            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                            num_worst_tokens=world * x.size(0))[0]

    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        small, big = inputs(8, H), inputs(4096, 7168)  # big: past the first 32 MiB RDMA region
        step(*small)
        torch.cuda.synchronize()
        with pytest.raises(RuntimeError, match=r"must grow to \d+ and \d+ bytes for this call, which cannot happen "
                                               r"inside CUDA-graph capture"):
            with torch.cuda.graph(torch.cuda.CUDAGraph(), stream=side):
                step(*big)
        assert step(*big).size(0) == world * 4096  # outside capture it grows and runs
        torch.cuda.synchronize()
    buf.check_errors()
    buf.destroy()
    return 1


def test_internode_capture_refuses_a_grow_on_every_rank(mps):
    from uccl_ep_train.backends.internode import internode_available
    if not internode_available():
        pytest.skip("native module without the internode kernels / proxies")
    assert run_ranks(_internode_capture_refusals, 2, timeout=300,
                     env={"UCCL_EP_BACKEND": "native", "UCCL_EP_RANKS_PER_NODE": "1"}, **gpu_ranks(2)) == [1, 1]
