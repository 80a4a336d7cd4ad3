"""ZeRO with bf16 Adam moments (PrecisionConfig.exp_avg_dtype / exp_avg_sq_dtype: Megatron-LM's
--use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16) in the storages, the
offload tiers and the checkpoints.

- Layouts: stages 0-3 over 2 ranks, stage 3 with the states offloaded to host memory and stage 2 to
  swap files, reproduce the single process's bf16-moment run (loss curve and parameters, rtol 1e-5);
  every tier holds the moments in bf16, 4 bytes per element of the partition where fp32 moments take 8.
  (The moments' own numerics against torch: tests/ops/test_adam_state_dtypes.py.)
- Checkpoints: a bf16-moment run saved and resumed continues its curve bitwise; its checkpoint loads
  into an fp32-moment run exactly, and an fp32-moment checkpoint into a bf16-moment run rounded to
  nearest even (megazero/checkpoint/loader.py's rule); resharded (2 ranks' stage 2 into one rank's
  stage 3) it loads bitwise.
Planted: a storage whose moments stay fp32 whatever the setting (the bytes check fails); the saver
writing the moments as fp32 (the checkpoint test's dtype check fails).
"""

import torch

from tests.layouts import assemble_params, assert_close, assert_params_match, setup_training, small_config
from megazero.models.param_info import param_info

STEPS, LAYERS = 4, 2


def bf16_moments(cfg, states: str = "bf16"):
    cfg.precision.exp_avg_dtype = cfg.precision.exp_avg_sq_dtype = states
    return cfg


def states_run(ctx, cfg, dp, save=None, load=None):
    """Trains cfg on the first tp*pp*dp ranks (from a checkpoint when `load`; `save` = (directory,
    step)); returns the loss curve, the full parameters, the memory report, the dtypes of every
    tensor holding moments, this rank's partition size and, after a load, every parameter's moments
    as loaded beside the checkpoint's own."""
    from megazero.checkpoint import CheckpointReader, CheckpointSaver, load_checkpoint
    from megazero.checkpoint.saver import canonical_name
    from megazero.training.lr_schedule import learning_rate
    from megazero.parallel.topology import Topology
    from megazero.training import train_step
    from megazero.zero.state_access import safe_get_full_fp32_param, safe_get_full_optimizer_state

    par = cfg.parallel
    groups = ctx.groups(
        Topology(
            world_size=par.tensor_parallel * par.pipeline_parallel * dp,
            tp=par.tensor_parallel,
            pp=par.pipeline_parallel,
        )
    )
    if groups is None:
        return None
    state, source = setup_training(cfg, groups)
    engine, start, loaded = state.engine, 0, None
    if load is not None:
        start, reader = load_checkpoint(state, load).iteration, CheckpointReader(load)
        loaded = {
            (name := canonical_name(p, engine), key): (
                safe_get_full_optimizer_state(p, key),
                reader.full_tensor(name, key),
            )
            for chunk in state.chunks
            for p in chunk.parameters()
            for key in ("exp_avg", "exp_avg_sq")
        }
    curve = {}
    for it in range(start, cfg.train_iters):
        curve[it + 1] = train_step(state, source.batch(it), learning_rate(cfg.optimizer, it + 1, cfg.train_iters)).loss
        if save is not None and save[1] == it + 1:
            CheckpointSaver(save[0], "state-dtypes").save(state, (it + 1) * cfg.global_batch_size)
    return {
        "coords": tuple(groups.coords),
        "curve": curve,
        "loaded": loaded,
        "memory": engine.memory.report(),
        "params": {
            n: (safe_get_full_fp32_param(p), param_info(p).tp_shard)
            for chunk in state.chunks
            for n, p in chunk.named_parameters()
        },
        "dtypes": sorted({str(t.dtype) for s in engine.storages() for t in moment_tensors(s)}),
        "partition": sum(s.layout.partition_size for s in engine.storages()),
    }


def moment_tensors(storage):
    """Every tensor holding the moments, in whichever tier: the device, host memory, swap buffers."""
    if storage.offload is None:
        return [storage.exp_avg, storage.exp_avg_sq]
    offload = storage.offload
    found = [offload.on_device[k] for k in ("exp_avg", "exp_avg_sq")]
    if offload.host is not None:
        found += [offload.host[k] for k in ("exp_avg", "exp_avg_sq")]
    if offload.swapper is not None:
        found += [b[k] for b in offload.swapper.sets for k in ("exp_avg", "exp_avg_sq")]
    return found


def many(ctx, jobs):
    return [states_run(ctx, cfg, dp, **options) for cfg, dp, options in jobs]


def _last(results):
    return max((r for r in results if r is not None), key=lambda r: r["coords"][2])


def test_bf16_moments_at_every_stage_and_tier_match_one_process(dist_pool, tmp_path):
    layouts = {
        "stage 0": (dict(stage=0), {}),
        "stage 1": (dict(stage=1), {}),
        "stage 2": (dict(stage=2), {}),
        "stage 3": (dict(stage=3), {}),
        "stage 3 host": (dict(stage=3), {"offload_optimizer": {"device": "cpu"}, "sub_group_size": 500}),
        "stage 2 nvme": (
            dict(stage=2),
            {
                "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path), "pipeline_read": True},
                "sub_group_size": 700,
            },
        ),
    }
    jobs = [(bf16_moments(small_config(steps=STEPS, layers=LAYERS)), 1, {})]
    jobs += [
        (bf16_moments(small_config(steps=STEPS, layers=LAYERS, zero_extra=extra, **layout)), 2, {})
        for layout, extra in layouts.values()
    ]
    results = list(zip(*dist_pool(2).run(many, jobs)))
    reference = _last(results[0])
    steps = sorted(reference["curve"])
    for (name, (_, extra)), got in zip(layouts.items(), results[1:]):
        last = _last(got)
        assert_close([last["curve"][s] for s in steps], [reference["curve"][s] for s in steps], name)
        assert_params_match(assemble_params(got), assemble_params(results[0]), name)
        for r in got:
            assert r["dtypes"] == ["torch.bfloat16"], f"{name}: moments kept as {r['dtypes']}"
            tier = {"cpu": "host_", "nvme": "nvme_"}.get(extra.get("offload_optimizer", {}).get("device"), "")
            assert r["memory"][f"{tier}optimizer_states"] == 4 * r["partition"] > 0, name


def test_bf16_moment_checkpoints_resume_bitwise_and_cross_dtypes_by_the_stated_rule(dist_pool, tmp_path):
    bf16, fp32 = (bf16_moments(small_config(steps=STEPS, layers=LAYERS, stage=2), s) for s in ("bf16", "fp32"))
    a, b = str(tmp_path / "bf16"), str(tmp_path / "fp32")
    pool = dist_pool(2)
    straight = pool.run(many, [(bf16, 2, {"save": (a, 2)})])
    resumed, widened = zip(*pool.run(many, [(bf16, 2, {"load": a}), (fp32, 2, {"load": a, "save": (b, 3)})]))
    one = bf16_moments(small_config(steps=STEPS, layers=LAYERS, stage=3))
    rounded, resharded = zip(*pool.run(many, [(bf16, 2, {"load": b}), (one, 1, {"load": a})]))
    tail = {k: v for k, v in _last([s[0] for s in straight])["curve"].items() if k > 2}
    assert _last(resumed)["curve"] == tail, "a bf16-moment run resumed off its own curve"
    for r in (x for x in widened if x is not None):  # bf16 checkpoint into fp32 moments: exact
        for what, (live, saved) in r["loaded"].items():
            assert torch.equal(live, saved) and torch.equal(saved, saved.bfloat16().float()), what
    for r in (x for x in rounded if x is not None):  # fp32 checkpoint into bf16 moments: rounded
        for what, (live, saved) in r["loaded"].items():
            assert torch.equal(live, saved.bfloat16().float()), what
        changed = sum(int((live != saved).sum()) for live, saved in r["loaded"].values())
        assert changed > 0, "the fp32 checkpoint held only bf16 values: the rounding was not exercised"
    for r in (x for x in resharded if x is not None):  # 2 ranks' stage 2 into 1 rank's stage 3
        for what, (live, saved) in r["loaded"].items():
            assert torch.equal(live, saved), what
    from safetensors import safe_open
    from megazero.checkpoint import CheckpointReader

    first = CheckpointReader(a).path / "rank_00000.safetensors"
    with safe_open(str(first), framework="pt") as f:
        dtypes = {key.rsplit("/", 1)[1]: f.get_tensor(key).dtype for key in f.keys() if "/" in key}
    assert dtypes["exp_avg"] == dtypes["exp_avg_sq"] == torch.bfloat16 and dtypes["fp32"] == torch.float32
