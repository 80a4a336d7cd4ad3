"""ZenFlow (zero/zenflow/optimizer.py, zero/zenflow/windows.py), its two exact limits, its real shape against
DeepSpeed's rules, and its exact resume.

- `topk_ratio` 1.0 (every column selected, stepped on the device every step) follows the run with
  the device optimizer, and `topk_ratio` 0 with `update_interval` 1 and no overlap follows plain
  optimizer offload, both to rtol 1e-5, at stages 1, 2 and 3 on 2 ranks (the CPU Adam with overlap
  still runs beside the first one, its result overwritten by the device's). At stage 1 the first
  limit runs with `offload` (the selected moments in host memory, visiting the device each step).
- Between the limits, the real shape (top-k columns, windows, overlap, re-selection; and
  `update_interval` "auto", whose windows adapt) follows DeepSpeedZenFlow, a plain-torch
  transcription of DeepSpeed's ZenFlow on the full tensors, to rtol 1e-5.
- A run in the real shape (top 25%, windows of 2, overlap, re-selection, warm-up) saved
  mid-window with a pending CPU result resumes exactly: the same losses and parameters; so does an
  "auto" run saved inside a 3-step window, whose window state saved again one step later is the
  straight run's.

Planted: the device part stepped with step count t - 1 fails the first limit; the accumulator,
or the selected columns' device moments, left out of the checkpoint kinds fails the resume (its
parameters); the CPU Adam stepped with the window count instead of the global step fails the real
shape; "auto"'s window state not restored (its step count: the losses; its sums: the state saved
again) fails its resume; under the stream checker (test_stream_check's grid has a ZenFlow "auto"
layout) starting the CPU Adam thread without the host synchronizing on the accumulation first is
a read-after-write race naming the accumulator. Not told apart here: on a CPU device `offload`'s
copies of the moments to and from the device are no-ops (the same tensors), so only its memory
report is checked.
"""

import torch

from tests.layouts import (
    assemble_params,
    assert_close,
    assert_params_match,
    microbatches,
    small_config,
    with_padded_vocab,
)
from megazero.checkpoint.reader import CheckpointReader
from tests.zero.test_offload import many

STEPS = 4


def zenflow(**flow):
    return {"offload_optimizer": {"device": "cpu"}, "zenflow": flow} if flow else {}


def cfg(stage, extra, steps=STEPS):
    return small_config(stage=stage, steps=steps, layers=2, zero_extra=extra)


def test_zenflow_limits_and_resume(dist_pool, tmp_path):
    top1 = {"topk_ratio": 1.0, "update_interval": 2, "overlap_step": True}
    top0 = {"topk_ratio": 0.0, "update_interval": 1}
    real = {
        "topk_ratio": 0.25,
        "update_interval": 2,
        "overlap_step": True,
        "full_warm_up_rounds": 1,
        "select_strategy": "step",
        "select_interval": 4,
    }
    ckpt = str(tmp_path / "ckpt")
    stages = (1, 2, 3)
    jobs = []
    for stage in stages:
        moments_home = {"offload": True} if stage == 1 else {}
        jobs += [
            (cfg(stage, {}), 2, {}),
            (cfg(stage, zenflow(**top1, **moments_home)), 2, {}),
            (cfg(stage, {"offload_optimizer": {"device": "cpu"}}), 2, {}),
            (cfg(stage, zenflow(**top0)), 2, {}),
        ]
    resumed = cfg(3, zenflow(**real), steps=8)
    jobs += [(resumed, 2, {"save": (ckpt, 6)}), (resumed, 2, {"load": ckpt})]
    # update_interval "auto" in a model where its windows last 2 or 3 steps: saved one step into a
    # 3-step window (steps 8-10), with the last window's result pending.
    auto = {
        "topk_ratio": 0.01,
        "update_interval": "auto",
        "auto_ratio": 0.9,
        "overlap_step": True,
        "full_warm_up_rounds": 1,
    }
    resumed_auto = small_config(
        stage=3, steps=12, layers=2, zero_extra=zenflow(**auto), model_extra={"hidden_size": 96, "ffn_hidden_size": 192}
    )
    jobs += [
        (resumed_auto, 2, {"save": (ckpt + "-auto", 8)}),
        (resumed_auto, 2, {"load": ckpt + "-auto", "save": (ckpt + "-auto-again", 9)}),
        (resumed_auto, 2, {"save": (ckpt + "-auto-straight", 9)}),
    ]
    # ... and resumed at tp 2 (the window's sums are whole matrices' in every layout).
    resumed_auto_tp2 = small_config(
        stage=3,
        tp=2,
        steps=12,
        layers=2,
        zero_extra=zenflow(**auto),
        model_extra={"hidden_size": 96, "ffn_hidden_size": 192},
    )
    jobs += [(resumed_auto_tp2, 1, {"load": ckpt + "-auto"})]
    ranks = [r for r in dist_pool(4).run(many, jobs) if r[0] is not None]
    by_job = list(zip(*ranks))  # per job: the working ranks' results
    for s, stage in enumerate(stages):
        device, top1_run, offload, top0_run = by_job[4 * s : 4 * s + 4]
        for name, got, want in (
            (f"stage {stage} topk 1.0 vs device", top1_run, device),
            (f"stage {stage} topk 0 vs offload", top0_run, offload),
        ):
            assert_close(list(got[0]["curve"].values()), list(want[0]["curve"].values()), name)
            assert_params_match(assemble_params(got), assemble_params(want), name)
        # The memory report: every element's master on the device at topk 1 (and its moments with
        # two int64 indices; with offload the moments in host memory instead), none at topk 0.
        for r in top1_run:
            memory = r["memory"]
            assert 0.95 * memory["host_master"] <= memory["master"] <= memory["host_master"]  # padding
            if stage == 1:
                assert memory["optimizer_states"] == 4 * memory["master"]
                assert memory["host_optimizer_states"] == 2 * memory["host_master"] + 2 * memory["master"]
            else:
                assert memory["optimizer_states"] == 6 * memory["master"]
        assert all(r["memory"]["master"] == 0 for r in top0_run)
    for at, straight, again in ((6, *by_job[12:14]), (8, *by_job[14:16])):
        assert again[0]["curve"] == {k: v for k, v in straight[0]["curve"].items() if k > at}
        want = assemble_params(straight)
        for name, value in assemble_params(again).items():
            assert (value == want[name]).all(), name
    straight, tp2 = by_job[14], by_job[17]
    assert_close(list(tp2[0]["curve"].values()), [v for k, v in straight[0]["curve"].items() if k > 8], "auto at tp 2")
    assert_params_match(assemble_params(tp2), assemble_params(straight), "auto resumed at tp 2")
    # The window's running state round-trips: saved one step in, resumed, saved again one step
    # later, it is the straight run's at that step (two steps in, the same sums to the bit).
    windows = [
        CheckpointReader(ckpt + suffix).indexes[0]["zenflow_window"]
        for suffix in ("-auto", "-auto-again", "-auto-straight")
    ]
    assert windows[0]["steps"] == 1 and windows[0]["sums"], windows[0]
    assert windows[1] == windows[2] and windows[1]["steps"] == 2, windows[1:]


def test_column_sums_of_a_piece_match_the_matrix_reference():
    """A partition piece starts and ends mid-row: its column L1 norms equal those of the
    whole matrix with the elements outside the piece zeroed (planted: the head run placed at
    column 0 fails)."""
    import torch

    from megazero.zero.zenflow.columns import column_abs_sums, top_columns

    torch.manual_seed(0)
    rows, columns = 7, 5
    matrix = torch.randn(rows * columns)
    for start, end in [(0, 35), (3, 35), (0, 12), (3, 4), (6, 29), (10, 15), (0, 0)]:
        masked = torch.zeros_like(matrix)
        masked[start:end] = matrix[start:end]
        want = masked.view(rows, columns).abs().sum(0)
        torch.testing.assert_close(column_abs_sums(matrix[start:end], start, columns), want)
    sums = torch.tensor([3.0, 9.0, 1.0, 7.0])
    assert sorted(top_columns(sums, 0.5).tolist()) == [1, 3]
    assert top_columns(sums, 0.01).tolist() == [1] and len(top_columns(sums, 0.0)) == 0
    assert len(top_columns(sums, 1.0)) == 4


def test_the_planner_counts_zenflow_as_the_engine_does():
    from tests.layouts import with_padded_vocab

    from megazero.config.memory_estimate import plan_bytes

    plain = plan_bytes(with_padded_vocab(cfg(2, {"offload_optimizer": {"device": "cpu"}})), 2)
    flow = plan_bytes(with_padded_vocab(cfg(2, zenflow(topk_ratio=0.5, update_interval=2, overlap_step=True))), 2)
    assert plain["master"] == 0 and flow["host_master"] == plain["host_master"]
    assert flow["master"] == 0.5 * flow["host_master"] and flow["optimizer_states"] == 6 * flow["master"]
    # two fp32 accumulators and the fp32 gradients' copy: 12 bytes per element beside plain's staging
    assert flow["host_offload_buffers"] > plain["host_offload_buffers"] + 2 * flow["host_master"]
    # offload: the selected moments move to host memory, the indices stay
    away = plan_bytes(with_padded_vocab(cfg(2, zenflow(topk_ratio=0.5, update_interval=2, offload=True))), 2)
    assert away["optimizer_states"] == 4 * away["master"] == 4 * flow["master"]
    assert away["host_optimizer_states"] == plain["host_optimizer_states"] + 2 * flow["master"]


# --- a plain-torch transcription of DeepSpeed's ZenFlow, the oracle of its real shape ---------------


class DeepSpeedZenFlow:
    """DeepSpeed's ZenFlow step on a plain module's full tensors, written from its code
    (zenflow_stage_1_and_2.py, ZenFlowSelectiveAdamW, the CPU Adam's step_id), not from megazero's
    flat partitions: for a 2-D weight the columns are `weight[:, j]`, a 1-D one is selected whole;
    at a selection the CPU master takes the device's values (DeepSpeed's sync_fp32_param_from_gpu)
    and the selected columns' moments restart from zero, their step count does not; every step the
    selected columns take torch's AdamW with the steps since the warm-up's end; every gradient is
    accumulated and at a window's end the CPU's AdamW takes the window's mean with the global step
    count (step_id = micro_step + 1); with overlap its result reaches the module at the next
    window's end, the selected columns always keep the device's values. No warm-up here; the
    selection is renewed at a window start every `select_every` steps."""

    def __init__(self, model, *, topk, interval, overlap, select_every, weight_decay, betas, eps, auto_ratio=0.99):
        from tests.references.reference_rules import megatron_decays

        self.params = [(n, p, weight_decay if megatron_decays(n, p) else 0.0) for n, p in model.named_parameters()]
        self.topk, self.k, self.overlap, self.every = topk, interval, overlap, select_every
        self.auto_ratio, self.window, self.l1, self.windows = auto_ratio, 0, {}, []
        self.adam = dict(betas=betas, eps=eps)
        self.master = {n: p.detach().clone() for n, p, _ in self.params}
        self.moments = {n: (torch.zeros_like(p), torch.zeros_like(p)) for n, p, _ in self.params}
        self.acc = {n: torch.zeros_like(p) for n, p, _ in self.params}
        self.columns, self.selected, self.pending = {}, {}, False

    def _adamw(self, value, grad, moments, step, lr, wd):
        """torch's AdamW on `value` in place, at step count `step`."""
        value.grad = grad
        opt = torch.optim.AdamW([value], lr=lr, weight_decay=wd, foreach=False, **self.adam)
        opt.state[value] = {"step": torch.tensor(float(step - 1)), "exp_avg": moments[0], "exp_avg_sq": moments[1]}
        opt.step()
        value.grad = None

    def _cols(self, name, tensor):
        return tensor[:, self.columns[name]] if tensor.dim() == 2 else tensor

    def _put_selected(self, name, target):
        if target.dim() == 2:
            target.data[:, self.columns[name]] = self.selected[name][0]
        else:
            target.data.copy_(self.selected[name][0])

    def _select(self):
        for name, p, _ in self.params:
            if name in self.columns:  # the device's values become the master's
                self._put_selected(name, self.master[name])
        for name, p, _ in self.params:
            if p.dim() == 2:
                norms = p.grad.abs().sum(0)
                self.columns[name] = torch.topk(norms, max(1, int(self.topk * len(norms)))).indices.sort().values
            else:
                self.columns[name] = None
            value = self._cols(name, self.master[name]).clone()
            self.selected[name] = (value, (torch.zeros_like(value), torch.zeros_like(value)))

    def of_record(self) -> dict:
        """The weights of record (what the engine's fp32 view and a checkpoint give): the CPU's
        master, the selected columns at the device's values."""
        out = {}
        for name, _, _ in self.params:
            out[name] = self.master[name].clone()
            self._put_selected(name, out[name])
        return out

    def _apply(self):
        for name, p, _ in self.params:
            p.data.copy_(self.master[name])
            self._put_selected(name, p)

    def _window_ends(self, s: int) -> bool:
        """A fixed interval's windows end every k steps; "auto" ends one where int(auto_ratio x
        matrices) have topk x (their other columns' L1, summed over the window) >= (1 - topk) x (their
        selected columns' L1, averaged over it), or before a re-selection."""
        self.window += 1
        if self.k != "auto":
            return s % self.k == 0
        caught, matrices = 0, 0
        for name, p, _ in self.params:
            if p.dim() < 2:
                continue
            selected = float(self._cols(name, p.grad).abs().sum())
            other = max(0.0, float(p.grad.abs().sum()) - selected)
            total = self.l1.get(name, (0.0, 0.0))
            self.l1[name] = (total[0] + selected, total[1] + other)
            matrices += 1
            caught += self.topk * self.l1[name][1] >= (1 - self.topk) * self.l1[name][0] / self.window
        return caught >= int(self.auto_ratio * matrices) or bool(self.every and s % self.every == 0)

    def step(self, s: int, lr: float) -> None:
        if self.window == 0 and (
            s == 1
            or (
                self.every
                and (s - 1) % self.every == 0
                and (self.k == "auto" or (s - 1) // self.every != (s - 1 - self.k) // self.every)
            )
        ):
            self._select()
        for name, p, wd in self.params:
            value, moments = self.selected[name]
            self._adamw(value, self._cols(name, p.grad).clone(), moments, s, lr, wd)
            self._put_selected(name, p)
            self.acc[name] += p.grad
        if not self._window_ends(s):
            return
        if self.overlap and self.pending:
            self._apply()
        for name, _, wd in self.params:
            self._adamw(self.master[name], self.acc[name] / self.window, self.moments[name], s, lr, wd)
            self.acc[name].zero_()
        if not self.overlap:
            self._apply()
        self.pending = True
        self.windows.append(self.window)
        self.window, self.l1 = 0, {}


def deepspeed_zenflow_run(cfg, flow: dict) -> dict:
    """The GPT of `cfg` trained by DeepSpeedZenFlow on the batches the engine's runs see."""
    from tests.references.reference_rules import megatron_lr, plain_gpt

    cfg = with_padded_vocab(cfg)
    model, opt, adam = plain_gpt(cfg.model, cfg.seed), cfg.optimizer, cfg.optimizer.adam
    zen = DeepSpeedZenFlow(
        model,
        topk=flow["topk_ratio"],
        interval=flow["update_interval"],
        overlap=flow["overlap_step"],
        select_every=flow["select_interval"],
        weight_decay=adam.weight_decay,
        betas=(adam.beta1, adam.beta2),
        eps=adam.eps,
        auto_ratio=flow.get("auto_ratio", 0.99),
    )
    source = microbatches(cfg)
    curve = {}
    for done in range(cfg.train_iters):
        loss_sum = 0.0
        for tokens in source.batch(done):
            loss = model(tokens[:, :-1], tokens[:, 1:]).float().sum() / (cfg.global_batch_size * cfg.model.seq_length)
            loss.backward()
            loss_sum += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), opt.clip_grad)
        zen.step(
            done + 1,
            megatron_lr(
                done,
                lr=opt.lr,
                min_lr=opt.min_lr,
                warmup=opt.warmup_iters,
                decay=cfg.train_iters,
                style=opt.decay_style,
            ),
        )
        model.zero_grad(set_to_none=True)
        curve[done + 1] = loss_sum
    return {"curve": curve, "params": zen.of_record(), "windows": zen.windows}


def test_zenflow_real_shape_follows_deepspeeds_rules(dist_pool):
    """The engine's ZenFlow in its real shape (top 25% of columns, windows of 2, overlap, a
    re-selection at step 5) equals DeepSpeedZenFlow above, one rank at stage 2 and two at stage 3
    (where each rank holds part of a matrix: the column norms are summed over the shard group):
    losses and parameters to rtol 1e-5 over 8 steps. Between the two exact limits this is what
    tells the bookkeeping apart from the algorithm: which columns, which step counts, which window
    lands when. And `update_interval` "auto" (two ranks, stage 2, a re-selection at step 7) ends
    the reference's windows, which adapt (lengths 2, 1, 1, 1, 1, 2, 1: not a fixed interval). At
    tp 2 (stage 2 fixed, stage 3 "auto") and pp 2 (stage 1 "auto") the layout chooses the columns
    and ends the windows one process does: a split matrix's norms and sums are its whole's, and each
    matrix (the tied embedding on two stages, a replicated one on two tensor-parallel ranks) counts
    once.

    Planted: the CPU Adam stepped with the window count instead of the global step (fixed
    interval, losses from step 6 on); "auto"'s selected L1 summed over the window instead of
    averaged, or its sums left unreduced over the shard group (windows end elsewhere); at tp 2,
    a row- or a column-split matrix's columns chosen by its shard's norms, its "auto" sums left
    per shard, or a matrix counted on each rank that holds it."""
    flow = {
        "topk_ratio": 0.25,
        "update_interval": 2,
        "overlap_step": True,
        "select_strategy": "step",
        "select_interval": 4,
    }
    auto = {
        "topk_ratio": 0.15,
        "update_interval": "auto",
        "auto_ratio": 0.5,
        "overlap_step": True,
        "select_strategy": "step",
        "select_interval": 6,
    }
    jobs = [
        (cfg(2, zenflow(**flow), steps=8), 1, {}),
        (cfg(3, zenflow(**flow), steps=8), 2, {}),
        (cfg(2, zenflow(**auto), steps=10), 2, {}),
        (small_config(stage=1, pp=2, steps=10, layers=2, zero_extra=zenflow(**auto)), 1, {}),
        (small_config(stage=3, tp=2, steps=10, layers=2, zero_extra=zenflow(**auto)), 1, {}),
        (small_config(stage=2, tp=2, steps=8, layers=2, zero_extra=zenflow(**flow)), 1, {}),
    ]
    results = dist_pool(2).run(many, jobs)
    want = deepspeed_zenflow_run(cfg(2, zenflow(**flow), steps=8), flow)
    want_auto = deepspeed_zenflow_run(cfg(2, zenflow(**auto), steps=10), auto)
    assert len(set(want_auto["windows"])) > 1, want_auto["windows"]
    for name, index, reference in (
        ("stage 2, one rank", 0, want),
        ("stage 3, two ranks", 1, want),
        ("auto, stage 2, two ranks", 2, want_auto),
        ("auto, stage 1, pp 2", 3, want_auto),
        ("auto, stage 3, tp 2", 4, want_auto),
        ("stage 2, tp 2", 5, want),
    ):
        got = [r[index] for r in results if r[index] is not None]
        assert_close(list(got[0]["curve"].values()), list(reference["curve"].values()), name)
        assert_params_match(assemble_params(got), reference["params"], name)
