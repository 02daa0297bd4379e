"""`uccl-ep-train bench low-latency`: its per-rank records fold into one record per (backend, op, hook, timing)
with the mean over ranks, the slowest rank and the mean host time of the call (api timing) (the bench itself needs GPUs and
runs in the device runs whose records are in benchmarks/results)."""
from uccl_ep_train.apps.bench.low_latency import build_parser, summarise


def test_records_fold_over_ranks_with_host_time():
    recs = [dict(rank=r, backend="native", op="dispatch_bf16", hook=False, timing="api", us=us, host_us=host,
                 ranks=2) for r, us, host in ((0, 100.0, 80.0), (1, 140.0, 120.0))]
    recs += [dict(rank=r, backend="native", op="dispatch_bf16", hook=False, timing="kernel", us=40.0 + r, ranks=2)
             for r in (0, 1)]
    recs += [dict(rank=r, backend="native", op="dispatch_send_bf16", hook=True, timing="api", us=10.0 + r,
                  host_us=5.0, ranks=2) for r in (0, 1)]
    out = {(s["op"], s["hook"], s["timing"]): s for s in summarise(recs)}
    assert set(out) == {("dispatch_bf16", False, "api"), ("dispatch_bf16", False, "kernel"),
                        ("dispatch_send_bf16", True, "api")}
    d = out[("dispatch_bf16", False, "api")]
    assert (d["us"], d["us_max"], d["host_us"]) == (120.0, 140.0, 100.0) and "rank" not in d
    k = out[("dispatch_bf16", False, "kernel")]
    assert (k["us"], k["us_max"]) == (40.5, 41.0) and "host_us" not in k
    assert out[("dispatch_send_bf16", True, "api")]["us"] == 10.5


def test_shape_defaults_are_deepep_low_latency_test_shape():
    args = build_parser().parse_args([])
    assert (args.num_tokens, args.hidden, args.num_experts, args.num_topk) == (128, 7168, 256, 8)
