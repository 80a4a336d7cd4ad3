"""--gpu's verdict (megazero.dry_run.fits): each rank's reserved peak against the datasheet's memory,
the worst rank named with what to change. Planted: the allocated peak compared instead of the
reserved one (rank 1 then fits), or the capacity taken in GiB (rank 1 then fits) fails it."""

from megazero.dry_run.fits import capacity_bytes, gpus, verdict, verdict_text

GB, MiB = 10**9, 2**20
ARGV = [
    "--num-layers",
    "2",
    "--hidden-size",
    "256",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "64",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--train-iters",
    "1",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "1000",
    "--tensor-model-parallel-size",
    "2",
    "--zero-stage",
    "1",
    "--bf16",
]


def _rank(rank, peak, reserved, stands_for=1, owner="activations"):
    owners = {"model states": peak // 4, "activations": peak // 4, "backward": peak // 4}
    owners[owner] = peak - sum(v for k, v in owners.items() if k != owner)
    return {
        "rank": rank,
        "stands_for": stands_for,
        "memory": {"peak": peak, "reserved_peak": reserved, "peak_by_owner": owners},
    }


def test_capacities_are_the_datasheets():
    assert {k: capacity_bytes(g) for k, g in gpus().items()} == {"a100": 80 * GB, "h100": 80 * GB, "h200": 141 * GB}
    assert all("datasheet" in g["source"] for g in gpus().values())


def test_worst_rank_is_named_with_the_flags_that_lower_its_memory():
    from megazero.dry_run.job import job_config

    cfg = job_config(ARGV, 4)
    # rank 1: allocated 79 GB, reserved 81 GB (over 80e9 bytes, under 80 GiB); role rank 2 stands for 3
    result = {
        "ranks": [_rank(0, 40 * GB, 42 * GB), _rank(1, 79 * GB, 81 * GB), _rank(2, 70 * GB, 85 * GB, stands_for=3)]
    }
    fit = verdict(result, "h100", cfg)
    assert [row["fits"] for row in fit["ranks"]] == [True, False, False] and not fit["fits"]
    assert fit["worst_rank"] == 2
    advice = fit["advice"]
    assert advice.startswith(
        f"rank 2 reserves {85 * GB / MiB:,.0f} MiB of the NVIDIA H100 SXM's "
        f"{80 * GB / MiB:,.0f} MiB: {5 * GB / MiB:,.0f} MiB over (4 of the 5 ranks checked"
    ), advice
    for flag in (
        "--micro-batch-size (now 2)",
        "--recompute-activations",
        "--sequence-parallel",
        "--tensor-model-parallel-size / --pipeline-model-parallel-size",
    ):
        assert flag in advice, (flag, advice)
    # model states the largest owner: the optimizer step's flags (ZeRO stage 3, offload) first, then
    # the activations' and the backward's (each a quarter of the peak)
    states = verdict({"ranks": [_rank(0, 90 * GB, 90 * GB, owner="model states")]}, "h100", cfg)["advice"]
    assert "most of it model states and " in states, states
    assert (
        states.index("--zero-stage 3 (now 1)")
        < states.index("--zero-offload-optimizer cpu")
        < states.index("--micro-batch-size (now 2)")
    ), states
    # the same job on an H200 fits, with the room to spare on the fullest rank
    roomy = verdict(result, "h200", cfg)
    assert roomy["fits"] and roomy["advice"].endswith(
        f"every rank fits, {56 * GB / MiB:,.0f} MiB to spare on the fullest"
    )
    text = verdict_text(fit)
    assert text.count("DOES NOT FIT") == 2 and text.splitlines()[-1] == advice
