"""The EAGLE drafter: speculative rollouts and its training in the rollout's long tail (TLT)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal, get_args

from megatron_tlt.config.checks import ConfigError, _require_at_least_one, check_choices

DrafterPrecision = Literal["auto", "fp32", "bf16", "fp8"]
DRAFTER_PRECISIONS = get_args(DrafterPrecision)
"""drafter/precision.py says what each means (it imports torch, so they live here)."""


@dataclasses.dataclass(kw_only=True)
class ColdStartConfig:
    """The drafter's cold start (``tlt warmup-drafter``): the initial policy answers some prompts and the drafter
    trains on its responses, before RL's first step. Made on first use and cached under a hash of this section
    (a response cap that caps nothing left out), with what it reads of the policy, the prompts and the drafter's
    training (``commands/start.py``); ``tlt warmup-drafter`` makes one from the same keys (its flags set them)."""

    enabled: bool = False
    """With speculation on and no drafter.init_dir: start from the cold start instead of random weights."""
    prompts: int = 1024
    """Training prompts, one response of the policy each, over all data-parallel ranks."""
    eval_prompts: int = 128
    """Held-out prompts for the before / after figures (top-1 agreement, acceptance length)."""
    epochs: int = 3
    """Passes of training over the responses."""
    lr: float = 1e-3
    """Learning rate of its training (drafter.lr is the online steps')."""
    eval_depth: int = 2
    """Draft depth of the acceptance-length figure."""
    max_response_tokens: int | None = None
    """The longest response the policy writes for it (training and held-out); null, or a value above
    rollout.max_response_tokens: that cap (the run's config.yaml writes it). A response cut short still teaches the
    drafter the policy's next tokens, and the few that run to a long cap set the time the cold start's answering
    takes."""

    def response_cap(self, rollout_cap: int) -> int:
        """The cap the cold start's responses run to, given the rollout's."""
        return min(self.max_response_tokens or rollout_cap, rollout_cap)

    def __post_init__(self) -> None:
        _require_at_least_one("drafter.cold_start", prompts=self.prompts, eval_prompts=self.eval_prompts,
                              epochs=self.epochs, eval_depth=self.eval_depth)
        if self.max_response_tokens is not None and self.max_response_tokens < 1:
            raise ConfigError(f"drafter.cold_start.max_response_tokens must be >= 1 or null (the rollout's cap), got "
                              f"{self.max_response_tokens}")
        if not self.lr > 0:
            raise ConfigError(f"drafter.cold_start.lr must be > 0, got {self.lr}")


@dataclasses.dataclass(kw_only=True)
class DrafterConfig:
    """The EAGLE drafter: speculative rollouts, and its training on ranks idle in the rollout long tail (TLT)."""

    depth: int = 0
    """Speculation depth K: the most draft tokens the rollout engines' EAGLE drafter proposes a step (0: no
    speculation). BEG-MAB picks each step's depth among speculation.depths, up to this."""
    spot_training: bool = False
    """Train the drafter on ranks whose rollout share is done, until the slowest rank is done."""
    lr: float = 1e-3
    """Learning rate of the drafter's online steps (the spot trainer's, or the serial schedule's); its cold
    start has its own, ``cold_start.lr``."""
    buffer_tokens: int = 65536
    """Feature rows kept for drafter training; the oldest whole sequences are dropped first."""
    pack_tokens: int = 1024
    """Training rows per drafter micro-step at most (a preempted one stops within one draft step). The spot trainer
    packs fewer, down to 128, where its idle windows are too short for a full pack (``drafter/pack_budget.py``;
    ``drafter/pack_tokens`` says what it used). A sequence with more rows is split into chunks that cannot attend
    to the earlier ones: keep it above the longest prompt + response."""
    pack_order: Literal["shuffled", "newest"] = "shuffled"
    """Which buffered sequences a step's micro-steps train on first: ``shuffled`` (a fresh random order over the
    whole buffer each step, different on each rank) or ``newest`` (the newest first, the packs made so far cycled
    again: a long idle tail trains the last step's few groups over and over)."""
    heads_version: Literal["features", "newest"] = "features"
    """The policy embedding and LM head the drafter trains with: ``features`` (those of the policy that made the
    newest features, so heads and features agree, as in the serial schedule) or ``newest`` (the policy after the
    last update, one version ahead of every feature in the buffer)."""
    hidden_weight: float = 1.0
    ce_weight: float = 0.1
    tv_weight: float = 0.0
    """Weight of the total-variation distance between the policy's and the drafter's next-token distributions in
    the drafter's loss (``drafter/loss.py``): 1 - tv is the acceptance of a sampled draft at temperature 1, so
    this term trains for acceptance itself. 0: EAGLE's loss only (the shipped cold start is made with 0)."""
    unroll_steps: int = 1
    """Draft steps each training row is unrolled over (training-time test, as EAGLE-3 and HASS train; the
    loss is their mean): at step k the drafter reads its own step k-1 prediction where step 1 reads the
    policy's feature, as vLLM drafts the k-th token. 1: the policy's features only (EAGLE-1). Each step costs
    about one more forward and backward pass of the drafter."""
    schedule: Literal["idle", "serial"] = "idle"
    """When the drafter trains, with ``spot_training`` on: ``idle`` (TLT: on ranks whose rollout share is done,
    until the slowest rank is done, preempted then) or ``serial`` (the peers' co-training, as NeMo-RL and vime
    schedule it: after the update, on the critical path, ``serial_tokens`` rows per rank each step; the
    baseline arm of bench/tlt_end_to_end.py)."""
    serial_tokens: int = 0
    """Drafter training rows per rank per step with ``schedule: serial``, on average over the run: micro-steps
    train whole packs (up to ``pack_tokens`` rows), so a step trains until the rows owed so far are trained, or
    the buffer gives none."""
    spot_duty_cycle: float | None = None
    """Fraction of a rank's idle time the spot trainer may train: after a micro-step of t seconds it rests
    t * (1 - d) / d. null: decided when the run starts (``drafter/device_defaults.py``): 1.0 on GPU, where each rank
    trains on its own device; 0.25 on CPU, where the ranks share one memory bus and an idle rank's training slows
    the ranks still generating."""
    spot_cost_bound: float | None = 0.02
    """Share of the rollout the spot trainer may cost the ranks still generating before its duty cycle backs off.
    Each step measures it (drafter/spot_rollout_cost: the generating ranks' engine steps that ran while another
    rank of their node trained, against steps of the same batch size and depth that ran while none did,
    ``drafter/neighbour_slowdown.py``); above the bound the duty cycle is halved, below half of it raised by 1.1x,
    never above spot_duty_cycle (drafter/duty_cycle: the one used). None: the duty cycle stays as set."""
    precision: DrafterPrecision = "auto"
    """How the drafter trains. auto: fp8 only through a backend (Transformer Engine or torchao) that
    megatron_tlt/drafter/fp8_measured.json says trained at >= 1.05x bf16's tokens/s on this GPU (by name) in the mode
    the trainer runs (eager; ``bench/drafter_precision.py --record`` adds rows), else bf16 on GPU, fp32 on CPU. fp8:
    through TE, else torchao's float8 training, measured or not; refused at start-up, saying why, where neither can
    run. The path taken and why are logged and in summary.json (drafter/precision, drafter/precision_reason)."""
    init_dir: str | None = None
    """Start from this EAGLE drafter directory (e.g. made by ``tlt warmup-drafter``) instead of random weights."""
    cold_start: ColdStartConfig = dataclasses.field(default_factory=ColdStartConfig)
    """How the drafter starts when no ``init_dir`` is given: from a cold start of the initial policy, or random."""
    probe_prompts: int = 0
    """Speculating engines check every rollout's acceptance (the first after each policy sync and drafter
    push): an acceptance below ``acceptance_alarm`` is an ERROR line and counts in ``spec/acceptance_alarms``
    (a drafter lost or broken in the push). With probe_prompts > 0 each engine also answers this many
    fixed prompts greedily at full depth right after the sync (``spec/probe_acceptance_rate``): a check
    that does not depend on the sampling temperature or the depths BEG-MAB chose, at the cost of a
    generation per step."""
    acceptance_alarm: float = 0.05
    """Accepted share of a rollout's (or probe's) draft tokens below which the alarm fires."""
    quality_rows: int = 512
    """With speculation on: feature rows per rank of a held-out slice of each step's rollouts (the first sample
    of each group, every group, in prompt order, whole sequences up to this many rows), never trained on. On
    it, each step, the serving drafter, the run's starting drafter (the cold start) and a freshly trained
    candidate are measured alike: teacher-forced acceptance per draft position and the expected acceptance
    length at depth ``depth``, at the rollout's temperature (``drafter/quality.py``), beside the
    policy's entropy; in summary.json as drafter/quality/* and on the step's TLT line. Costs one policy forward
    over the slice. 0: off (and no push gate)."""
    quality_every: int | None = None
    """Measure the drafters (``quality_rows``) and decide a push every this many steps, from step 1; a candidate
    trains on meanwhile. null: decided when the run starts (``drafter/device_defaults.py``): every step on GPU,
    where one forward over the slice is a sliver of a step; every 4th on CPU."""
    push_gate: bool = True
    """A drafter trained online replaces the one the engines serve only when it measures at least as well on
    the held-out slice (``quality_rows``); otherwise the serving one stays and training goes on
    (drafter/pushes, drafter/pushes_declined). False: every trained drafter is pushed."""

    def __post_init__(self) -> None:
        if self.probe_prompts < 0 or not 0.0 <= self.acceptance_alarm <= 1.0:
            raise ConfigError(f"drafter.probe_prompts must be >= 0 and acceptance_alarm in [0, 1], got "
                              f"{self.probe_prompts}, {self.acceptance_alarm}")
        if self.depth < 0 or self.buffer_tokens < 1 or self.pack_tokens < 1:
            raise ConfigError(f"drafter.depth must be >= 0 and buffer_tokens, pack_tokens >= 1, got "
                              f"{self.depth}, {self.buffer_tokens}, {self.pack_tokens}")
        if self.unroll_steps < 1:
            raise ConfigError(f"drafter.unroll_steps must be >= 1 (1: no unrolling), got {self.unroll_steps}")
        check_choices(self, "drafter")
        if self.quality_every is not None and self.quality_every < 1:
            raise ConfigError(f"drafter.quality_every must be >= 1 or null (the device's default), got "
                              f"{self.quality_every}")
        if self.quality_rows < 0:
            raise ConfigError(f"drafter.quality_rows must be >= 0 (0: no held-out measure), got {self.quality_rows}")
        if min(self.hidden_weight, self.ce_weight, self.tv_weight) < 0:
            raise ConfigError(f"drafter.hidden_weight, ce_weight and tv_weight must be >= 0, got {self.hidden_weight}, "
                              f"{self.ce_weight}, {self.tv_weight}")
        if not self.lr > 0:
            raise ConfigError(f"drafter.lr must be > 0, got {self.lr}")
        if self.spot_cost_bound is not None and not 0.0 < self.spot_cost_bound < 1.0:
            raise ConfigError(f"drafter.spot_cost_bound must be in (0, 1) or null, got {self.spot_cost_bound}")
        if self.spot_duty_cycle is not None and not 0.0 < self.spot_duty_cycle <= 1.0:
            raise ConfigError(f"drafter.spot_duty_cycle must be in (0, 1], got {self.spot_duty_cycle}")
        if self.schedule == "serial" and not (self.spot_training and self.serial_tokens >= 1):
            raise ConfigError("drafter.schedule=serial trains the drafter after the update: it needs "
                              f"drafter.spot_training=true and drafter.serial_tokens >= 1, got spot_training="
                              f"{str(self.spot_training).lower()}, serial_tokens={self.serial_tokens}")
        if self.init_dir is not None and not (Path(self.init_dir).expanduser() / "model.safetensors").is_file():
            raise ConfigError(f"drafter.init_dir {self.init_dir}: no model.safetensors there (expected an EAGLE "
                              "drafter directory, e.g. from `tlt warmup-drafter`)")
