"""The drafter's training state on one rank: the drafter, its optimizer, its feature buffer, its packs.

Every rank holds a replica. During rollout an idle rank runs ``micro_step`` (one pack, one Adam step)
as often as the spot trainer lets it; at the end of rollout ``average_replicas`` makes every replica
the token-weighted mean of those that trained, so every engine gets one version. Adam's moments stay
per rank (they are not averaged: a rank that did not train keeps its own).

Nothing here touches the policy, the global RNGs or a process group except ``average_replicas``.
"""

from __future__ import annotations

import dataclasses
import statistics

import torch
import torch.distributed as dist
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from megatron_tlt.drafter.buffer import HiddenStateBuffer
from megatron_tlt.drafter.loss import drafter_loss
from megatron_tlt.drafter.model import EagleDrafter
from megatron_tlt.drafter.packing import DrafterPack, pack_sequences
from megatron_tlt.model_config import PolicyArchitecture


@dataclasses.dataclass(frozen=True, kw_only=True)
class DrafterTrainingSettings:
    lr: float
    buffer_tokens: int
    pack_tokens: int
    hidden_weight: float
    ce_weight: float
    seed: int


class DrafterTrainer:
    def __init__(self, arch: PolicyArchitecture, settings: DrafterTrainingSettings):
        self.arch, self.settings = arch, settings
        self.drafter = EagleDrafter(arch, seed=settings.seed)
        self.optimizer = torch.optim.AdamW(self.drafter.parameters(), lr=settings.lr, weight_decay=0.0)
        self.buffer = HiddenStateBuffer(settings.buffer_tokens)
        self._embedding_vh: torch.Tensor | None = None
        self._lm_head_vh: torch.Tensor | None = None
        self._packs: list[DrafterPack] = []
        self._packs_stale = False
        self._next_pack = 0
        self.reset_phase_stats()

    # -------------------------------------------------------------- inputs, refreshed every RL step

    def set_policy_heads(self, embedding_vh: torch.Tensor, lm_head_vh: torch.Tensor) -> None:
        """The policy's current (unpadded) embedding and LM head: frozen inputs, never trained here."""
        self._embedding_vh, self._lm_head_vh = embedding_vh.detach(), lm_head_vh.detach()

    def add_sequences(self, token_ids: list[list[int]], features: list[torch.Tensor]) -> None:
        """This step's sequences and their post-final-norm features. Called on the critical path (the
        log-prob pass), so it only stores them: packing waits for the first micro-step, in idle time."""
        self.buffer.extend(token_ids, features)
        self._packs_stale = True

    def _repack(self) -> None:
        # Newest first: the freshest policy's features are trained on before older ones.
        self._packs = pack_sequences(reversed(self.buffer.sequences()), self.settings.pack_tokens)
        self._next_pack = 0
        self._packs_stale = False

    # -------------------------------------------------------------- one micro-step

    def micro_step(self) -> int:
        """Train on the next pack (cycling); returns its tokens, 0 when there is nothing to train on."""
        if self._packs_stale:
            self._repack()
        if not self._packs or self._embedding_vh is None:
            return 0
        pack = self._packs[self._next_pack % len(self._packs)]
        self._next_pack += 1
        self.drafter.train()
        token_embeds = self._embedding_vh[pack.input_ids_t]
        pred = self.drafter(token_embeds, pack.features_th, pack.position_ids_t, pack.segment_ids_t)
        loss, metrics = drafter_loss(pred, pack.target_features_th, self._lm_head_vh,
                                     hidden_weight=self.settings.hidden_weight, ce_weight=self.settings.ce_weight)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self._losses.append(float(loss))
        self._agreements.append(float(metrics["top1_agreement"]))
        self.tokens_trained += pack.num_tokens
        return pack.num_tokens

    def reset_phase_stats(self) -> None:
        self.tokens_trained = 0
        self._losses: list[float] = []
        self._agreements: list[float] = []

    def phase_stats(self) -> dict[str, float]:
        """This rank's drafter loss and top-1 agreement (means over its micro-steps) and tokens trained."""
        return {"loss": statistics.fmean(self._losses) if self._losses else float("nan"),
                "top1_agreement": statistics.fmean(self._agreements) if self._agreements else float("nan"),
                "tokens": float(self.tokens_trained)}

    # -------------------------------------------------------------- one version for every engine

    @torch.no_grad()
    def average_replicas(self, group=None) -> int:
        """Make every replica the mean of the replicas, weighted by the tokens each trained this phase
        (collective). Returns the total tokens; with none trained anywhere nothing changes."""
        weight = float(self.tokens_trained)
        total = torch.tensor([weight], dtype=torch.float64)
        dist.all_reduce(total, group=group)
        if total.item() == 0:
            return 0
        flat = parameters_to_vector(self.drafter.parameters()).float() * weight
        dist.all_reduce(flat, group=group)
        vector_to_parameters((flat / total.item()).to(self.drafter.dtype), self.drafter.parameters())
        return int(total.item())
