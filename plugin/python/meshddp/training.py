"""What a training loop uses around DDP and the optimizer: meshddp's LR schedule (LrScheduler, the
C++ optimizer/lr_scheduler.h) for any optimizer with param_groups, and the gradient norm and
clipping of plain DDP over DP x TP (clip_grad_norm_, the C++ common/grad_norm.h), which counts each
element of a torch-TP model's DTensor and plain params once."""

import math

import torch

from meshddp import _C
from meshddp.ddp import DistributedDataParallel


class LrScheduler:
    """meshddp's LR (and weight-decay) schedule: Megatron's OptimizerParamScheduler (linear warm-up,
    then constant / linear / cosine decay to min_lr; optionally a weight decay rising from start_wd to
    end_wd), the C++ LrScheduler's arithmetic and state (Note [Schedule semantics, as Megatron] in
    optimizer/lr_scheduler.h).

        sched = meshddp.LrScheduler(meshddp.LrScheduleConfig(max_lr=1e-3, warmup_steps=100,
                                                             decay_steps=1000, decay_style="cosine"))
        sched.attach(opt)          # a meshddp.DistributedOptimizer or any torch.optim optimizer
        ...; opt.step(); sched.step()

    attach() sets each param group's "lr" to the schedule's LR times the group's ratio to the
    optimizer's default lr, as it is when attached (and "weight_decay" likewise, when the config
    schedules it; a group with its own non-zero weight decay over a zero default keeps it), now and
    after every step()."""

    def __init__(self, config):
        if not isinstance(config, _C.LrScheduleConfig):
            raise TypeError(f"meshddp.LrScheduler: config must be a meshddp.LrScheduleConfig, got {type(config).__name__}")
        self._impl = _C._LrScheduler(config)
        self._targets = []

    def attach(self, optimizer):
        if any(target is optimizer for target, _, _ in self._targets):
            raise ValueError(f"meshddp.LrScheduler.attach: this {type(optimizer).__name__} is already attached to this "
                             f"scheduler (its LR follows the schedule since); attach each optimizer once")
        base_lr = optimizer.defaults.get("lr")
        if not isinstance(base_lr, (int, float)) or not base_lr > 0:
            raise ValueError(f"meshddp.LrScheduler.attach: the optimizer's default lr is {base_lr!r}; give it the "
                             f"schedule's max_lr so each group's ratio to it is defined")
        base_wd = optimizer.defaults.get("weight_decay")
        if self.config.schedules_weight_decay() and base_wd is None:
            raise ValueError("meshddp.LrScheduler.attach: the optimizer has no default weight_decay, but the schedule "
                             "sets one (start_wd, end_wd)")
        lr_ratio, wd_ratio = [], []
        for group in optimizer.param_groups:
            lr_ratio.append(group["lr"] / base_lr)
            wd = group.get("weight_decay", 0.0)
            # A group whose decay differs from a zero default keeps its own value: NaN marks it.
            wd_ratio.append(wd / base_wd if base_wd else (0.0 if wd == 0 else math.nan))
        self._targets.append((optimizer, lr_ratio, wd_ratio))
        self._apply()

    def step(self, increment=1):
        """After each successful optimizer step (a skipped one does not count, as in Megatron)."""
        self._impl.step(increment)
        self._apply()

    def steps(self):
        return self._impl.steps()

    def lr(self):
        """The LR the next optimizer step uses."""
        return self._impl.lr()

    def weight_decay(self):
        return self._impl.weight_decay()

    @property
    def config(self):
        return self._impl.config

    def state_dict(self):
        """The C++ scheduler's state: every config field and the step count, as strings (exact)."""
        return dict(self._impl.state())

    def load_state_dict(self, state_dict, use_checkpoint_config=False):
        """Restores the step count (every config field must equal this scheduler's unless
        use_checkpoint_config) and applies it to the attached optimizers."""
        self._impl.load_state(dict(state_dict), use_checkpoint_config)
        self._apply()

    def _apply(self):
        lr = self._impl.lr()
        wd = self._impl.weight_decay() if self.config.schedules_weight_decay() else None
        for optimizer, lr_ratio, wd_ratio in self._targets:
            if len(optimizer.param_groups) != len(lr_ratio):
                raise RuntimeError(f"meshddp.LrScheduler: the optimizer had {len(lr_ratio)} param groups when "
                                   f"attached and has {len(optimizer.param_groups)} now; attach after adding every group")
            for group, lr_r, wd_r in zip(optimizer.param_groups, lr_ratio, wd_ratio):
                group["lr"] = lr * lr_r
                if wd is not None and not math.isnan(wd_r):
                    group["weight_decay"] = wd * wd_r
            optimizer.defaults["lr"] = lr
            if wd is not None:
                optimizer.defaults["weight_decay"] = wd


def _plain_ddp(ddp, who):
    if not isinstance(ddp, DistributedDataParallel):
        raise TypeError(f"meshddp.{who}: pass the meshddp.DistributedDataParallel (its flat buffers know which "
                        f"ranks hold which gradient), not {type(ddp).__name__}")
    if ddp.config.use_distributed_optimizer:
        raise RuntimeError(
            f"meshddp.{who}: the gradients are sharded for the distributed optimizer (data_parallel_sharding_strategy="
            f"'{ddp._strategy}'), so each DP rank holds the reduced gradient of its shard only; set "
            f"meshddp.DistributedOptimizerConfig(clip_grad_norm=max_norm) instead (its step() clips and reports "
            f"StepResult.grad_norm)")
    ddp.finish_grad_sync()  # a no-op once done; through the DDP, for its checks


def _chunks(ddp, who):
    """`ddp` as a list of plain DDPs: a model chunk, or a list of them (every chunk this rank holds on
    a pipeline, e.g. each meshddp.pipelining.PipelineStage's submod)."""
    chunks = list(ddp) if isinstance(ddp, (list, tuple)) else [ddp]
    for chunk in chunks:
        _plain_ddp(chunk, who)
    return chunks


def grad_norm(ddp):
    """The L2 norm of the whole model's gradient over DP x TP (the DP mean, TP shards joined, each
    element once), after finish_grad_sync() (done here if not yet). A collective: every rank calls it
    and gets the same value. Plain DDP only. On a pipeline ("pp" dim) the norm of every stage's
    gradient (a weight tied across stages once): pass a list of every chunk (DDP) this rank holds."""
    return _C._grad_norm([c._engine for c in _chunks(ddp, "grad_norm")])


def clip_grad_norm_(ddp, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    """torch.nn.utils.clip_grad_norm_ for a model wrapped in meshddp's plain DDP (DP x TP, DTensor
    params of torch TP and plain params together): grad_norm(ddp), then every gradient (its slot in
    the flat buffer: .grad and .main_grad) scaled by min(max_norm / (norm + 1e-6), 1), torch's rule.
    Returns the norm before clipping, as a 0-dim float64 tensor. A collective over the mesh; after
    backward (it finishes the gradient sync), before the optimizer. Under ZeRO-1 it refuses: use
    OptimizerConfig(clip_grad_norm=...). foreach (torch's choice of kernels) is accepted and has no
    effect: the norm and the scaling run over the flat buffers. On a pipeline, `ddp` is a list of every
    chunk this rank holds, clipped by the norm of the whole pipeline (grad_norm)."""
    if float(norm_type) != 2.0:
        raise ValueError(f"meshddp.clip_grad_norm_: only norm_type=2.0 is supported, got {norm_type!r}")
    chunks = _chunks(ddp, "clip_grad_norm_")
    norm = _C._clip_grad_norm_([c._engine for c in chunks], float(max_norm), bool(error_if_nonfinite))
    return torch.tensor(norm, dtype=torch.float64)
