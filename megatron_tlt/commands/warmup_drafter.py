"""``tlt warmup-drafter`` on one rank: a drafter trained offline before RL, so runs need not start from
a random one.

On every rank, the same way the RL loop feeds its drafter:
  1. the policy (a checkpoint, or the run's initial policy) answers prompts of the dataset in its vLLM
     engine (self-distillation: the drafter learns the policy's own continuations, as it will see them);
  2. the log-prob pass captures the policy's features of those sequences;
  3. the drafter trains on them for a number of epochs, replicas averaged after each (token-weighted);
  4. held-out prompts measure it before and after: top-1 agreement with the policy, and the expected
     acceptance length at ``eval_depth``, teacher-forced on the held-out responses (``drafter/quality.py``,
     the measure the online push gate uses).
The engine does not speculate here: with the drafter still untrained, drafts would cost verification and win
nothing (a 135M policy answered 2-3x slower at depth 4 than without drafts on 2 cores, 2026-12-02), and the
teacher-forced measure needs none. The run's first step measures the engine's acceptance with the result.
Rank 0 writes the drafter as an EAGLE directory (``drafter/store.py``) that ``drafter.init_dir`` starts
an RL run from and vLLM serves. On the console (``rank_logs.console``, the RL steps' too) rank 0 shows a bar per
generation, advanced as its engine finishes prompts, and one for the training's micro-steps.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from megatron_tlt.commands import speculation_gate
from megatron_tlt.config import ColdStartConfig, TLTConfig
from megatron_tlt.drafter import store
from megatron_tlt.drafter.quality import AcceptanceTally, measure
from megatron_tlt.drafter.precision import resolve_precision
from megatron_tlt.drafter.serving import MeasureSettings
from megatron_tlt.drafter.trainer import DrafterTrainer
from megatron_tlt.formats.hf_io import atomic_output_dir
from megatron_tlt.model import mcore
from megatron_tlt.parallel import ParallelLayout
from megatron_tlt.rank_logs import console
from megatron_tlt.rl.actor import compute_logprobs, features_on_every_stage
from megatron_tlt.rl.inputs import curriculum
from megatron_tlt.rl.inputs.data import PromptExample
from megatron_tlt.rl.inputs.task import Task
from megatron_tlt.rl.rank_session import RankSession

logger = logging.getLogger(__name__)


def split_cold_start_prompts(task: Task, settings: ColdStartConfig,
                   curriculum_max_prompt_tokens: int = 0) -> tuple[list[PromptExample], list[PromptExample]]:
    """Training prompts from the dataset (with an easy-first curriculum, only its first steps' prompts: those the
    run starts with); held-out prompts from the task's own, else the dataset's tail."""
    examples = list(task.dataset.examples)
    if task.held_out:
        held_out = list(task.held_out[: settings.eval_prompts])
    else:  # a small dataset keeps at least three quarters of its prompts to train on
        eval_prompts = min(settings.eval_prompts, len(examples) // 4)
        if eval_prompts < settings.eval_prompts:
            logger.warning("the dataset's %d prompts: %d held out to evaluate the drafter, not %d", len(examples),
                           eval_prompts, settings.eval_prompts)
        held_out, examples = examples[len(examples) - eval_prompts:], examples[: len(examples) - eval_prompts]
    if curriculum_max_prompt_tokens:
        examples = [examples[i] for i in curriculum.easy_positions(examples, curriculum_max_prompt_tokens)]
    if len(examples) < settings.prompts:
        logger.warning("the dataset has %d prompts to train on, fewer than the %d asked for", len(examples),
                       settings.prompts)
    if not examples or not held_out:
        raise ValueError(f"the dataset's {len(task.dataset.examples)} prompts leave none to train on or to "
                         "evaluate with; lower --eval-prompts")
    return examples[: settings.prompts], held_out


def _progress(total: int, desc: str, unit: str, show: bool) -> tqdm:
    """A bar on the console: the terminal, also while the rank's own output goes to its log."""
    return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, file=console(), disable=not show)


class _Session:
    """One rank's policy, engine and drafter trainer for the warm-up."""

    def __init__(self, config: TLTConfig, policy_dir: Path | None, workdir: Path):
        settings = config.drafter.cold_start
        self.config, self.settings = config, settings
        self.rank = dist.get_rank()
        self.ranks = RankSession(config, policy_dir=policy_dir, show_progress=self.rank == 0)
        self.task: Task = self.ranks.task
        self.model, self.placement = self.ranks.model, self.ranks.placement
        self.mp_group = mcore.model_parallel_group()
        self.mp_size = dist.get_world_size(self.mp_group)
        self.dp_rank, self.dp_size = mcore.data_parallel_rank(), mcore.data_parallel_size()
        # The cold start's recipe, cached and shipped under keys that do not name the online pack order: it keeps the
        # order it was made with (its buffer is one step's responses; the online default shuffles across steps)
        d = dataclasses.replace(config.drafter, lr=settings.lr, pack_order="newest", heads_version="newest")
        # the warm-up keeps every feature it makes: its buffer holds them all
        self.trainer = DrafterTrainer(self.task.arch, d, seed=config.trainer.seed,
                                      precision=resolve_precision(d.precision), buffer_tokens=1 << 62)
        if d.init_dir is not None:
            self.trainer.drafter.load_tensors(store.read_drafter_tensors(d.init_dir, self.task.arch))
        self.engine = self.ranks.open_engine(workdir)  # no drafts: see the module's docstring
        self.ranks.sync(self.engine, self.trainer)

    def generate_with_features(self, prompts: list[PromptExample], seed: int, what: str):
        """This DP rank's share of ``prompts`` answered by the policy (shared out over its model-parallel
        group's engines), the sequences, their features and their prompts' lengths. Rank 0's bar, named by
        ``what``, counts its own engine's responses as they finish."""
        mine = prompts[self.dp_rank :: self.dp_size]
        own = self.placement.replica_share(mine)
        sequences = []
        if own:
            share = f" (rank 0's share of {len(prompts)})" if len(own) < len(prompts) else ""
            bar = _progress(len(own), f"cold start: {what}{share}", "response", show=self.rank == 0)
            sampling = self.ranks.sampling(n=1, temperature=self.config.rollout.temperature,
                                           seed=seed + self.placement.leader_rank)
            sampling = dataclasses.replace(sampling, max_tokens=self.settings.response_cap(sampling.max_tokens))
            result = self.engine.generate([e.prompt_ids for e in own], sampling,
                                          on_finished=lambda _, responses: bar.update(len(responses)))
            bar.close()
            sequences = [(list(e.prompt_ids) + responses[0], len(e.prompt_ids))
                         for e, responses in zip(own, result.token_ids)]
        gathered = [None] * self.mp_size
        dist.all_gather_object(gathered, sequences, group=self.mp_group)
        answered = [pair for part in self.placement.leaders_only(gathered) for pair in part]
        sequences, prompt_lengths = [seq for seq, _ in answered], [length for _, length in answered]
        result = compute_logprobs(self.model, sequences, vocab_size=self.task.arch.vocab_size,
                                  micro_batch_size=self.config.trainer.micro_batch_size,
                                  micro_batch_tokens=self.config.trainer.micro_batch_tokens,
                                  pad_id=self.task.tokenizer.pad_id, capture_hidden=True,
                                  max_feature_rows=self.trainer.buffer_tokens)
        # with PP > 1 the last stage shares the features, so every stage's ranks train the drafter
        sequences, features = features_on_every_stage(self.model, sequences, result)
        return sequences, features, prompt_lengths

    def evaluate(self, sequences, features, prompt_lengths, *, every_draft_sampling: bool = False) -> dict:
        """Drafter loss, top-1 agreement and the teacher-forced expected acceptance length at ``eval_depth`` over
        every rank's held-out sequences (counted once: on the first TP rank of the last pipeline stage), at the
        run's draft sampling. With ``every_draft_sampling`` and a sampled rollout, also the acceptance per position
        with each draft sampling (``acceptance_by_draft_sampling``): the cache key does not hold the draft sampling,
        so a cached cold start is judged for runs of either (commands/speculation_gate.py)."""
        depth = self.settings.eval_depth
        settings = MeasureSettings.from_config(self.config, depth=depth)
        own = self.config.speculation.draft_sampling
        samplings = {own: settings.greedy_draft}
        if every_draft_sampling and settings.temperature > 0:
            samplings = {"probabilistic": False, "greedy": True}
        sums = self.trainer.evaluate(sequences, features)  # zeros for a rank without sequences
        tallies = {name: AcceptanceTally.empty(depth) for name in samplings}
        stage = mcore.stage_info()
        if stage.tp_rank == 0 and stage.is_last_stage:
            embedding, lm_head = self.trainer.policy_heads
            chains = list(zip(sequences, features, prompt_lengths))
            with torch.no_grad():
                for name, greedy in samplings.items():
                    tallies[name] = measure(self.trainer.drafter, chains, embedding_vh=embedding, lm_head_vh=lm_head,
                                            **dataclasses.replace(settings, greedy_draft=greedy).measure_kwargs())
        else:
            sums = dict.fromkeys(sums, 0.0)
        # on the CPU on purpose: reduced over gloo, not NCCL
        totals = torch.cat([torch.tensor([sums["loss_sum"], sums["top1_sum"], sums["tokens"]], dtype=torch.float64),
                            *(tally.as_tensor().double() for tally in tallies.values())])
        dist.all_reduce(totals)
        width = len(AcceptanceTally.empty(depth).as_tensor())
        tallies = {name: AcceptanceTally.from_tensor(depth, totals[3 + i * width:3 + (i + 1) * width])
                   for i, name in enumerate(tallies)}
        result = {"loss": totals[0].item() / totals[2].item(), "top1_agreement": totals[1].item() / totals[2].item(),
                  "acceptance_length": tallies[own].expected_length,
                  "acceptance_by_position": tallies[own].acceptance_by_position}
        if len(tallies) > 1:
            result["acceptance_by_draft_sampling"] = {name: t.acceptance_by_position for name, t in tallies.items()}
        return result

    def train(self, show_progress: bool) -> int:
        """``epochs`` passes over the buffer, replicas averaged after each; returns tokens trained (all ranks)."""
        packs = torch.tensor([self.trainer.packs_in_buffer()])
        dist.all_reduce(packs, op=dist.ReduceOp.MAX)  # equal micro-step counts keep the ranks in step
        total = 0
        bar = _progress(self.settings.epochs * int(packs), "cold start: training the drafter", "micro-step",
                        show=show_progress)
        for epoch in range(self.settings.epochs):
            self.trainer.reset_phase_stats()
            for _ in range(int(packs)):
                self.trainer.micro_step()
                bar.update()
            loss = self.trainer.phase_stats()["loss"]
            total += self.trainer.average_replicas()
            bar.set_postfix(epoch=f"{epoch + 1}/{self.settings.epochs}", loss=f"{loss:.4f}")
        bar.close()
        return total


def warm_up_drafter_on_rank(config: TLTConfig, policy_dir: str | None, out_dir: str) -> dict | None:
    """Entry point of every rank; rank 0 writes ``out_dir`` and returns the before/after figures."""
    layout = ParallelLayout(tensor_parallel_size=config.parallel.tensor_parallel_size,
                            pipeline_parallel_size=config.parallel.pipeline_parallel_size,
                            seed=config.trainer.seed).initialize()
    session = None
    workdir = tempfile.mkdtemp(prefix="tlt-warmup-drafter-")  # the engine's model directory
    try:
        is_reporter = dist.get_rank() == 0
        settings = config.drafter.cold_start
        session = _Session(config, Path(policy_dir) if policy_dir is not None else None, Path(workdir))
        train_prompts, eval_prompts = split_cold_start_prompts(session.task, settings,
                                                               config.data.curriculum_max_prompt_tokens)
        seed = config.trainer.seed
        held_out = session.generate_with_features(eval_prompts, seed, "held-out responses")
        before = session.evaluate(*held_out)
        train_seqs, train_feats, _ = session.generate_with_features(train_prompts, seed + 1, "responses to train on")
        session.trainer.add_sequences(train_seqs, train_feats)
        tokens = session.train(show_progress=is_reporter)
        after = session.evaluate(*held_out, every_draft_sampling=True)
        figures = {
            "tokens_trained": tokens, "train_prompts": len(train_prompts), "eval_prompts": len(eval_prompts),
            "epochs": settings.epochs, "eval_depth": settings.eval_depth,
            "held_out_top1_agreement_before": before["top1_agreement"],
            "held_out_top1_agreement_after": after["top1_agreement"],
            "held_out_loss_before": before["loss"], "held_out_loss_after": after["loss"],
            "held_out_acceptance_length_before": before["acceptance_length"],
            "held_out_acceptance_length_after": after["acceptance_length"],
            "held_out_acceptance_by_position_after": after["acceptance_by_position"],
            **speculation_gate.measured_at(config),  # what a run that starts from it compares with its own
        }
        if "acceptance_by_draft_sampling" in after:
            figures[speculation_gate.BY_DRAFT_SAMPLING_KEY] = after["acceptance_by_draft_sampling"]
        if not is_reporter:
            return None
        source = session.ranks.initial_source
        info = dict(figures, step=0, policy=str(source or config.model.hf_dir), made_by="tlt warmup-drafter")
        with atomic_output_dir(out_dir) as staging:
            store.write_drafter_files(staging, session.task.arch, session.trainer.export_tensors(), info)
        return figures
    finally:
        if session is not None:
            session.ranks.close()
        shutil.rmtree(workdir, ignore_errors=True)
        layout.close()
