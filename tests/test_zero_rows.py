"""Zero rows on CPU ranks (issue #42): the reference backend against an oracle written here for the cases
where a rank sends nothing, a rank or a whole node receives nothing, or every token goes to one rank, with
DeepEP-style calls (the empty `recv_topk_weights` passed back to combine), biases, FP8 and cached dispatch;
one node and 3 emulated nodes x 2 ranks. And the native internode backend's worst-token check, which must
give every rank the same verdict."""
from __future__ import annotations

import pytest
import torch

from dist_utils import run_ranks

H, E = 128, 24  # 24 experts: 4 per rank at 6 ranks, 6 at 4

# case -> (top-k, tokens of rank r, experts the tokens may pick), for 6 ranks (and 4: the first 4)
CASES = {
    "last_rank_idle": (4, lambda r: 20 + r, lambda R: list(range(E - E // R))),
    "zero_tokens": (3, lambda r: 0 if r == 1 else 16, lambda R: list(range(E))),
    "idle_node": (4, lambda r: 0 if r == 2 else 12 + r, lambda R: list(range(E - 2 * E // R))),
    "one_rank": (4, lambda r: 8 + r, lambda R: list(range(E // R))),
}


def _inputs(rank: int, R: int, case: str, seed: int):
    K, tokens, experts = CASES[case]
    allowed = torch.tensor(experts(R))
    g = torch.Generator().manual_seed(seed * 101 + rank)
    T = tokens(rank)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    idx = torch.stack([allowed[torch.randperm(len(allowed), generator=g)[:K]] for _ in range(T)]) if T else \
        torch.empty(0, K, dtype=torch.int64)
    return x, idx, torch.rand(T, K, generator=g)


def _rounds(rank: int, world: int, device: str) -> dict:
    import torch.distributed as dist

    from uccl_ep_train import Buffer
    from uccl_ep_train.fp8 import per_token_cast_to_fp8

    buf = Buffer(dist.new_group(list(range(world))), int(1e6), 0)
    assert buf.backend_name == "reference"
    epr = E // world
    received = {}
    for seed, case in enumerate(CASES):
        everyone = [_inputs(r, world, case, seed) for r in range(world)]
        x, idx, w = everyone[rank]
        # the oracle: rows come in source-rank, then token order; each token once per rank it goes to
        mine = [(idx_s // epr == rank).any(1) for _, idx_s, _ in everyone]
        want_x = torch.cat([x_s[m] for (x_s, _, _), m in zip(everyone, mine)])
        local = lambda i: torch.where(i // epr == rank, i - rank * epr, -1)  # noqa: E731
        want_idx = torch.cat([local(i_s[m]) for (_, i_s, _), m in zip(everyone, mine)])
        want_w = torch.cat([w_s[m] * (i_s[m] // epr == rank) for (_, i_s, w_s), m in zip(everyone, mine)])
        for fp8 in (False, True):
            tag = f"rank {rank} {case}{' fp8' if fp8 else ''}"
            data = per_token_cast_to_fp8(x.float()) if fp8 else x
            per_rank, per_node, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
            rx, ridx, rw, counts, handle, _ = buf.dispatch(
                data, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node, is_token_in_rank=in_rank,
                num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
            rows = rx[0] if fp8 else rx
            expected = per_token_cast_to_fp8(want_x.float())[0] if fp8 and want_x.size(0) else want_x
            assert rows.shape == (want_x.size(0), H), tag
            assert want_x.size(0) == 0 or torch.equal(rows.view(torch.uint8), expected.view(torch.uint8)), tag
            assert torch.equal(ridx, want_idx) and torch.equal(rw, want_w), tag
            assert counts == [int((want_idx == e).sum()) for e in range(epr)], tag
            cached = buf.dispatch(data, handle=handle)[0]
            assert torch.equal((cached[0] if fp8 else cached).view(torch.uint8), rows.view(torch.uint8)), tag
            # DeepEP's call: the received weights go back as they came, (0, K) on a rank that got nothing
            y = (rows.float() * (rank + 1)).to(torch.bfloat16)
            bias = torch.randn(x.size(0), H, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
            out, out_w, _ = buf.combine(y, handle, topk_weights=rw, bias=bias)
            ranks_hit = torch.stack([(idx // epr == r).any(1) for r in range(world)], 1).float()
            src = per_token_cast_to_fp8(x.float())[0].float() if fp8 and x.size(0) else x.float()
            want = src.bfloat16().float() * (ranks_hit * (torch.arange(world) + 1)).sum(1, keepdim=True)
            torch.testing.assert_close(out.float(), want + bias.float(), rtol=2e-2, atol=2e-2, msg=tag)
            torch.testing.assert_close(out_w, w, msg=tag)  # every slot's weight comes back from its rank
            out, out_w, _ = buf.combine(y, handle)
            assert out_w is None and out.shape == (x.size(0), H), tag
        received[case] = int(want_x.size(0))
    buf.destroy()
    return received


@pytest.mark.parametrize("world,per_node", [(4, 4), (6, 2)])
def test_reference_zero_rows_match_the_oracle(world, per_node):
    got = run_ranks(_rounds, world, env={"UCCL_EP_RANKS_PER_NODE": str(per_node), "UCCL_EP_BACKEND": "reference"},
                    timeout=180)
    # the routing left empty the ranks the cases name
    assert got[-1]["last_rank_idle"] == 0 and all(got[r]["last_rank_idle"] for r in range(world - 1)), got
    assert got[-1]["idle_node"] == got[-2]["idle_node"] == 0, got
    assert got[0]["one_rank"] > 0 and all(got[r]["one_rank"] == 0 for r in range(1, world)), got


def test_worst_token_check_gives_every_rank_the_same_verdict():
    """Each rank passes every rank's receive count: the rank that receives the most decides, for all."""
    from uccl_ep_train.backends.internode import check_worst_tokens

    counts = [0, 5, 12, 3]
    check_worst_tokens(counts, 0)  # not given: nothing to check
    check_worst_tokens(counts, 12)
    with pytest.raises(RuntimeError, match=r"rank 2 receives 12 tokens, more than num_worst_tokens=11"):
        check_worst_tokens(counts, 11)
    check_worst_tokens([0, 0, 0], 1)  # nobody receives anything
