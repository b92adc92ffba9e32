"""The drafter's training state on one rank: the drafter, its optimizer, its feature buffer, its packs.

Every rank holds a replica. During rollout an idle rank runs ``micro_step`` (one pack, one Adam step)
as often as the spot trainer lets it; at the end of rollout ``average_replicas`` makes every replica
the token-weighted mean of those that trained, so every engine gets one version. Each rank keeps its own Adam
moments (those of the drafter it last trained): averaging them too measured no better (bench/RESULTS.md).

Nothing here touches the policy, the global RNGs or a process group except ``average_replicas``.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from megatron_tlt.config import DrafterConfig
from megatron_tlt.drafter.buffer import HiddenStateBuffer
from megatron_tlt.drafter.loss import drafter_loss
from megatron_tlt.drafter.model import EagleDrafter
from megatron_tlt.drafter.packing import DrafterPack, iter_packs, pack_sequences, pad_rows
from megatron_tlt.drafter.precision import TRANSFORMER_ENGINE, DrafterPrecision, autocast
from megatron_tlt.formats.architecture import PolicyArchitecture

_EMBEDDING, _LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"
POLICY_HEAD_NAMES = frozenset({_EMBEDDING, _LM_HEAD})
"""HF names of the policy tensors the drafter drafts with (to keep from a weight sync)."""
_OPEN_PACKS = 4  # first fit over this many packs at a time: nearly as tight as over all, built lazily
FP8_ROW_MULTIPLE = 16
"""FP8 GEMMs need row counts divisible by 16 (TE's, and torch._scaled_mm's under torchao, where the rows are the
inner dim of the weight gradient's GEMM): FP8 packs are padded to it, whichever backend runs them."""


class _Preempted(Exception):
    """Raised at a preemption point inside a micro-step: the step in flight is abandoned."""


def _no_preemption(*_) -> None:
    """The preemption point of a pass nobody preempts (``evaluate``)."""


def row_multiple(precision: DrafterPrecision) -> int:
    """What a pack's row count is padded to before the drafter runs on it (``packing.pad_rows``)."""
    return FP8_ROW_MULTIPLE if precision.fp8 else 1


class DrafterTrainer:
    def __init__(self, arch: PolicyArchitecture, settings: DrafterConfig, *, seed: int,
                 precision: DrafterPrecision = DrafterPrecision(torch.device("cpu"), torch.float32),
                 buffer_tokens: int | None = None):
        """``settings`` is the run's ``drafter`` section (lr, pack_tokens, loss weights); ``buffer_tokens``
        overrides its ``buffer_tokens`` (the offline warm-up keeps every feature it makes)."""
        self.arch, self.settings = arch, settings
        self.precision = p = precision
        self.drafter = EagleDrafter(arch, seed=seed, dtype=p.dtype, device=p.device, fp8_backend=p.fp8_backend)
        self.optimizer = torch.optim.AdamW(self.drafter.parameters(), lr=settings.lr, weight_decay=0.0)
        # On the drafter's device: features stay where the log-prob pass made them (no copy on the critical path).
        self.buffer_tokens = settings.buffer_tokens if buffer_tokens is None else buffer_tokens
        self.buffer = HiddenStateBuffer(self.buffer_tokens, device=p.device)
        self._embedding_vh: torch.Tensor | None = None
        self._lm_head_vh: torch.Tensor | None = None
        # What micro-steps train with: the heads of the policy that made the newest features (set when they
        # arrive), or the newest heads (heads_version: newest)
        self._train_heads: tuple[torch.Tensor, torch.Tensor] | None = None
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self._pack_order = torch.Generator().manual_seed(seed * 1000 + rank)  # ranks that train cover other packs
        self.pack_tokens = settings.pack_tokens
        """Rows per micro-step pack: ``drafter.pack_tokens``, or fewer where the spot trainer sizes them to its
        idle windows (``set_pack_tokens``)."""
        self._ordered: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._pack_stream: Iterator[DrafterPack] | None = None
        self._packs: list[DrafterPack] = []
        self._cycle = 0
        self._retry: DrafterPack | None = None
        self._drafter_loss = drafter_loss  # or its compiled form (compile)
        self.reset_phase_stats()

    def compile(self, **options) -> None:
        """Compile the micro-step's heavy regions in place with ``torch.compile(**options)``: the drafter's fc and
        decoder layer (every linear with FP8's amax, scale and cast beside its GEMM, attention, norm, SwiGLU) and the
        loss (the frozen LM head's GEMMs, the softmax over the vocabulary), forward and backward. Not the whole
        micro-step: its preemption points (callbacks that raise, gradient hooks), the rows a data-dependent mask
        keeps and the optimizer step would each break the graph, and fusing the casts with their GEMMs' neighbours
        is what FP8 needs. Parameter names stay (``nn.Module.compile``), so exports and checkpoints do too. The first
        micro-steps of each pack shape compile (seconds to minutes at 70B dims): the bench's compiled arms use it;
        ``tlt train`` does not yet (a compile in a rank's idle tail would outlast its preemption). Transformer
        Engine's layers run their own fused kernels and are not compiled here."""
        if self.precision.fp8_backend == TRANSFORMER_ENGINE:
            raise ValueError("a drafter in fp8 through Transformer Engine is not compiled (fp8_autocast's state is "
                             "not traced): TE fuses its FP8 casts itself")
        self.drafter.fc.compile(**options)
        for layer in self.drafter.layers:
            layer.compile(**options)
        self._drafter_loss = torch.compile(drafter_loss, **options)

    # -------------------------------------------------------------- inputs, refreshed every RL step

    wants_policy_heads = True
    """A rank session's weight sync keeps the policy's embedding and LM head for a drafter that trains."""

    def export_tensors(self) -> dict[str, torch.Tensor]:
        """The drafter's own weights in vLLM's names (what an engine loads)."""
        return self.drafter.export_tensors()

    def set_policy_heads(self, hf_tensors: dict[str, torch.Tensor]) -> None:
        """The policy's current (unpadded) embedding and LM head, from HF tensors holding
        ``POLICY_HEAD_NAMES`` (as a weight sync keeps them; a tied policy has no lm_head): frozen inputs,
        never trained here."""
        p = self.precision
        embedding_vh = hf_tensors[_EMBEDDING]
        self._embedding_vh = embedding_vh.detach().to(p.device, p.dtype)
        self._lm_head_vh = hf_tensors.get(_LM_HEAD, embedding_vh).detach().to(p.device, p.dtype)
        if self.settings.heads_version == "newest" or self._train_heads is None:
            self._train_heads = (self._embedding_vh, self._lm_head_vh)

    @property
    def policy_heads(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The policy's embedding [vocab, hidden] and LM head the drafter drafts with (after a sync)."""
        if self._embedding_vh is None:
            raise RuntimeError("the drafter has no policy embedding and LM head yet: sync the policy first")
        return self._embedding_vh, self._lm_head_vh

    def add_sequences(self, token_ids: list[list[int]], features: list[torch.Tensor]) -> None:
        """This step's sequences and their post-final-norm features. Called on the critical path (the
        log-prob pass), so it only stores them: packs are made one at a time by the micro-steps, in idle
        time, and only as many as idle time consumes (building all of them would copy the whole buffer
        each step, memory traffic that slows the ranks still generating on a shared CPU)."""
        self.buffer.extend(token_ids, features)
        if self._embedding_vh is not None:  # the policy that made these features drafts with these heads
            self._train_heads = (self._embedding_vh, self._lm_head_vh)
        sequences = self.buffer.sequences()
        if self.settings.pack_order == "newest":  # the freshest policy's features first
            self._ordered = list(reversed(sequences))
        else:  # across the whole buffer: a group's samples are near copies of each other
            self._ordered = [sequences[i] for i in torch.randperm(len(sequences), generator=self._pack_order).tolist()]
        self._restart_packs()

    def set_pack_tokens(self, rows: int) -> None:
        """Make the packs from now on hold up to ``rows`` rows. The buffer is packed again from its start, in the
        same order (the spot trainer calls this before a rollout's first micro-step, when this step's packs are not
        yet consumed); a dropped pack waiting to be retried is packed again with the rest."""
        if rows < 1:
            raise ValueError(f"pack rows must be >= 1, got {rows}")
        if rows != self.pack_tokens:
            self.pack_tokens = rows
            self._restart_packs()

    def _restart_packs(self) -> None:
        self._pack_stream = iter_packs(self._ordered, self.pack_tokens, open_packs=_OPEN_PACKS)
        self._packs, self._cycle, self._retry = [], 0, None

    def _next_pack(self) -> DrafterPack | None:
        """A dropped step's pack first, then new packs, then the packs made so far again (cycling)."""
        if self._retry is not None:
            pack, self._retry = self._retry, None
            return pack
        if self._pack_stream is not None:
            pack = next(self._pack_stream, None)
            if pack is not None:
                self._packs.append(pack)
                return pack
            self._pack_stream = None
        if not self._packs:
            return None
        self._cycle += 1
        return self._packs[(self._cycle - 1) % len(self._packs)]

    def packs_in_buffer(self) -> int:
        """Micro-steps in one pass over the buffer (makes every pack now)."""
        if self._pack_stream is not None:
            self._packs.extend(self._pack_stream)
            self._pack_stream = None
        return len(self._packs)

    # -------------------------------------------------------------- one micro-step

    def micro_step(self, should_stop: Callable[[], bool] = lambda: False) -> int:
        """Train on the next pack (cycling); returns its tokens, 0 when there is nothing to train on.

        ``should_stop`` is asked after each unrolled draft step of the forward pass, as the backward pass
        reaches each step's prediction, and after each pass: when it says yes the step is dropped (no update,
        0 returned, the pack comes first next time). A preempted rank is thus released within about one
        draft step's forward or backward, not a whole micro-step: packs of whole long sequences make
        micro-steps of a third of a second on the tiny default's CPU (bench/RESULTS.md).
        """
        if self._train_heads is None:
            return 0
        pack = self._next_pack()
        if pack is None:
            return 0
        self.drafter.train()

        def preemption_point(*_) -> None:  # also a gradient hook: returning None keeps the gradient
            if should_stop():
                raise _Preempted

        try:
            loss, metrics = self._loss(pack.to(self.precision.device), preemption_point)
            preemption_point()
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()  # a hook raising inside it abandons the rest of the pass
            preemption_point()
        except _Preempted:
            return self._drop(pack)
        self.optimizer.step()
        self._losses.append(loss.item())
        self._agreements.append(float(metrics["top1_agreement"]))
        self.tokens_trained += pack.num_tokens
        return pack.num_tokens

    @torch.no_grad()
    def evaluate(self, token_ids: list[list[int]], features: list[torch.Tensor]) -> dict[str, float]:
        """Loss and top-1 agreement summed over the EAGLE examples of these sequences, and their count
        (sums, so ranks can add them up)."""
        self.drafter.eval()
        totals = {"loss_sum": 0.0, "top1_sum": 0.0, "tokens": 0.0}
        for pack in pack_sequences(zip(token_ids, features), self.settings.pack_tokens):
            loss, metrics = self._loss(pack.to(self.precision.device))
            totals["loss_sum"] += float(loss) * pack.num_tokens
            totals["top1_sum"] += float(metrics["top1_agreement"]) * pack.num_tokens
            totals["tokens"] += pack.num_tokens
        return totals

    def _loss(self, pack: DrafterPack, preemption_point: Callable[..., None] = _no_preemption):
        """The mean over the unrolled draft steps of each step's loss on its valid rows; the metrics are
        step 1's (the first draft token's, comparable whatever the unrolling). ``preemption_point`` is
        called after each draft step's forward, and by a gradient hook on its prediction in the backward."""
        rows = pad_rows(pack, row_multiple(self.precision))
        with autocast(self.precision):
            embedding_vh, lm_head_vh = self._train_heads
            predictions, valid = self.drafter.unroll(embedding_vh[rows.input_ids_t], rows.features_th,
                                                     rows.position_ids_t, rows.segment_ids_t,
                                                     self.settings.unroll_steps, preemption_point)
        losses, first_metrics = [], None
        for pred_th, valid_t in zip(predictions, valid):
            if pred_th.requires_grad:  # not under evaluate's no_grad
                pred_th.register_hook(preemption_point)
            # The padding rows are cut off: the loss and its metrics see the pack's own rows only.
            keep_t = valid_t[:pack.num_tokens]
            if not bool(keep_t.any()):  # every segment shorter than this draft step
                break
            loss, metrics = self._drafter_loss(pred_th[:pack.num_tokens][keep_t], pack.target_features_th[keep_t],
                                         lm_head_vh, hidden_weight=self.settings.hidden_weight,
                                         ce_weight=self.settings.ce_weight, tv_weight=self.settings.tv_weight)
            losses.append(loss)
            first_metrics = first_metrics or metrics
        return torch.stack(losses).mean(), first_metrics

    def _drop(self, pack: DrafterPack) -> int:
        self.optimizer.zero_grad(set_to_none=True)
        self._retry = pack
        self.dropped_steps += 1
        return 0

    def reset_phase_stats(self) -> None:
        self.tokens_trained = 0
        self.dropped_steps = 0
        self._losses: list[float] = []
        self._agreements: list[float] = []

    def phase_stats(self) -> dict[str, float]:
        """This rank's drafter loss and top-1 agreement (means over its micro-steps), tokens trained,
        micro-steps dropped by preemption, and the feature rows in its buffer."""
        return {"loss": statistics.fmean(self._losses) if self._losses else float("nan"),
                "top1_agreement": statistics.fmean(self._agreements) if self._agreements else float("nan"),
                "tokens": float(self.tokens_trained), "dropped_steps": self.dropped_steps,
                "buffer_tokens": self.buffer.num_tokens}

    # -------------------------------------------------------------- one version for every engine

    @torch.no_grad()
    def average_replicas(self, group=None) -> int:
        """Make every replica the mean of the replicas, weighted by the tokens each trained this phase
        (collective). Returns the total tokens; with none trained anywhere nothing changes."""
        weight = float(self.tokens_trained)
        total = torch.tensor([weight], dtype=torch.float64, device=self.precision.device)  # NCCL: on the GPU
        dist.all_reduce(total, group=group)
        if total.item() == 0:
            return 0
        flat = parameters_to_vector(self.drafter.parameters()).float() * weight
        dist.all_reduce(flat, group=group)
        vector_to_parameters((flat / total.item()).to(self.drafter.dtype), self.drafter.parameters())
        return int(total.item())
