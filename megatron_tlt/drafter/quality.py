"""The drafter's quality measured apart from the rollout: teacher-forced acceptance on held-out sequences.

The rollout's own acceptance length mixes the drafter's quality with the depth BEG-MAB chose for each step
(and the batch sizes it met), so it cannot rank two drafters. This measure holds everything else fixed: the
same sequences, the same policy features and heads, the same depth, the same acceptance rule. For every
decoding position of a held-out sequence it runs the drafter as vLLM drafts (``EagleDrafter.unroll``: draft
step k reads the drafter's own step k-1 output) and asks, per draft step, with what probability verification
would accept the drafted token there:

    probabilistic drafting (temperature T > 0): sum_v min(p_v, q_v)      (1 - total variation)
    greedy drafting at T > 0:                   p(argmax q)
    greedy decoding (T = 0):                    1[argmax q == argmax p]

where p is the policy's distribution of that token (from its feature f_{t+1} and LM head) and q the
drafter's, both at temperature T. Teacher forcing: the chain is fed the tokens the policy actually sampled,
which is what verification keeps whenever it accepts. A chain starting at row r (x_<=r+1 verified, drafts
x_{r+2} .. x_{r+K+1}) is accepted to depth k with probability prod_{j<=k} a_j, so its expected acceptance
length at depth K (tokens per verification step, the bonus token included, as vLLM counts it) is

    1 + sum_{k=1..K} prod_{j=1..k} a_j(r)

Only chains that start at decoding positions (the last verified token is the prompt's last or later) and
have all K draft positions inside the sequence count: the measure is of the response, as the rollout is.

Results are sums (``AcceptanceTally``) so ranks add them up with one all-reduce. Pure tensor math apart from
running the drafter: no I/O, no process groups.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import Tensor

from megatron_tlt.drafter.model import EagleDrafter
from megatron_tlt.drafter.packing import DrafterPack, pack_sequences

_LOGIT_ROWS = 1024  # rows per [rows, vocab] logits block: bounds memory at a 128k vocabulary


@dataclasses.dataclass
class AcceptanceTally:
    """Sums over held-out chains; ``+`` adds two tallies, ``as_tensor``/``from_tensor`` carry one through an
    all-reduce."""

    depth: int
    position_sums: list[float]
    """Per draft step k = 1..depth: the sum over chains of the acceptance probability at step k."""
    length_sum: float = 0.0
    """The sum over chains of their expected acceptance length at ``depth``."""
    chains: int = 0
    entropy_sum: float = 0.0
    """The sum over decoding rows of the policy's entropy (nats, at the rollout temperature)."""
    entropy_rows: int = 0

    @classmethod
    def empty(cls, depth: int) -> AcceptanceTally:
        return cls(depth=depth, position_sums=[0.0] * depth)

    def __add__(self, other: AcceptanceTally) -> AcceptanceTally:
        if other.depth != self.depth:
            raise ValueError(f"cannot add tallies of depths {self.depth} and {other.depth}")
        return AcceptanceTally(self.depth, [a + b for a, b in zip(self.position_sums, other.position_sums)],
                               self.length_sum + other.length_sum, self.chains + other.chains,
                               self.entropy_sum + other.entropy_sum, self.entropy_rows + other.entropy_rows)

    def as_tensor(self) -> Tensor:
        return torch.tensor([*self.position_sums, self.length_sum, self.chains, self.entropy_sum,
                             self.entropy_rows], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, depth: int, values: Tensor) -> AcceptanceTally:
        v = values.double().tolist()
        return cls(depth, v[:depth], v[depth], int(round(v[depth + 1])), v[depth + 2], int(round(v[depth + 3])))

    @property
    def expected_length(self) -> float:
        """Mean expected acceptance length at ``depth`` (NaN without chains)."""
        return self.length_sum / self.chains if self.chains else float("nan")

    @property
    def acceptance_by_position(self) -> list[float]:
        """Mean acceptance probability at each draft step, the steps before it accepted (teacher-forced)."""
        return [s / self.chains if self.chains else float("nan") for s in self.position_sums]

    @property
    def mean_entropy(self) -> float:
        return self.entropy_sum / self.entropy_rows if self.entropy_rows else float("nan")


def acceptance_probability(draft_logits_rv: Tensor, target_logits_rv: Tensor, *, temperature: float,
                           greedy_draft: bool) -> Tensor:
    """Per row, the probability that verification accepts the drafted token (module docstring's rules)."""
    if temperature == 0.0:
        return (draft_logits_rv.argmax(-1) == target_logits_rv.argmax(-1)).float()
    p_rv = torch.softmax(target_logits_rv.float() / temperature, dim=-1)
    if greedy_draft:
        return p_rv.gather(-1, draft_logits_rv.argmax(-1, keepdim=True)).squeeze(-1)
    q_rv = torch.softmax(draft_logits_rv.float() / temperature, dim=-1)
    return torch.minimum(p_rv, q_rv).sum(-1)


def _entropy(target_logits_rv: Tensor, temperature: float) -> Tensor:
    if temperature == 0.0:
        return torch.zeros(target_logits_rv.shape[0])
    logp_rv = torch.log_softmax(target_logits_rv.float() / temperature, dim=-1)
    return -(logp_rv.exp() * logp_rv).sum(-1)


def _logits(hidden_th: Tensor, lm_head_vh: Tensor) -> Tensor:
    return torch.cat([(block @ lm_head_vh.T).float() for block in hidden_th.split(_LOGIT_ROWS)])


@torch.no_grad()
def measure_pack(drafter: EagleDrafter, pack: DrafterPack, decode_start_t: Tensor, *, embedding_vh: Tensor,
                 lm_head_vh: Tensor, depth: int, temperature: float, greedy_draft: bool) -> AcceptanceTally:
    """The tally of one pack; ``decode_start_t`` [t] is True where a chain may start at that row (its last
    verified token is the prompt's last or later)."""
    drafter.eval()
    device, dtype = drafter.fc.weight.device, drafter.dtype
    pack = pack.to(device)
    embedding_vh, lm_head_vh = embedding_vh.to(device, dtype), lm_head_vh.to(device, dtype)
    predictions, _ = drafter.unroll(embedding_vh[pack.input_ids_t], pack.features_th.to(dtype),
                                    pack.position_ids_t, pack.segment_ids_t, depth)
    target_logits_tv = _logits(pack.target_features_th.to(dtype), lm_head_vh)
    rows = pack.num_tokens
    segment_t = pack.segment_ids_t
    # a chain starting at row r uses rows r .. r + depth - 1 (draft step k at row r + k - 1): all in r's segment
    last_t = torch.arange(rows, device=device) + depth - 1
    whole_t = (last_t < rows) & (segment_t[last_t.clamp(max=rows - 1)] == segment_t)
    starts_t = whole_t & decode_start_t.to(device)
    tally = AcceptanceTally.empty(depth)
    tally.entropy_sum = float(_entropy(target_logits_tv[decode_start_t.to(device)], temperature).sum())
    tally.entropy_rows = int(decode_start_t.sum())
    if not bool(starts_t.any()):
        return tally
    start_rows = torch.nonzero(starts_t).squeeze(-1)
    accepted_to_depth = torch.ones(start_rows.numel(), device=device)
    length = torch.ones(start_rows.numel(), device=device)
    for k, pred_th in enumerate(predictions, start=1):
        at = start_rows + k - 1
        a = acceptance_probability(_logits(pred_th[at], lm_head_vh), target_logits_tv[at],
                                   temperature=temperature, greedy_draft=greedy_draft)
        tally.position_sums[k - 1] = float(a.sum())
        accepted_to_depth = accepted_to_depth * a
        length += accepted_to_depth
    tally.length_sum, tally.chains = float(length.sum()), int(start_rows.numel())
    return tally


def measure(drafter: EagleDrafter, sequences: Sequence[tuple[Sequence[int], Tensor, int]], *,
            embedding_vh: Tensor, lm_head_vh: Tensor, depth: int, temperature: float, greedy_draft: bool,
            pack_tokens: int) -> AcceptanceTally:
    """The tally of held-out ``(token_ids, features_th, prompt_len)`` sequences (features as the log-prob pass
    captures them: rows 0 .. len-2), each sequence in packs of its own, chunked as the drafter trains
    (``pack_tokens``): packing several together would give the same figures at several times the attention's
    cost (its masks span a pack's rows at every draft step)."""
    tally = AcceptanceTally.empty(depth)
    for token_ids, features_th, prompt_len in sequences:
        for pack in pack_sequences([(token_ids, features_th)], pack_tokens):
            # row t reads x_{t+1} and drafts x_{t+2}: its chain is a decoding step once x_{t+1} is the prompt's
            # last token or later, t >= prompt_len - 2
            tally = tally + measure_pack(drafter, pack, pack.position_ids_t >= prompt_len - 2,
                                         embedding_vh=embedding_vh, lm_head_vh=lm_head_vh, depth=depth,
                                         temperature=temperature, greedy_draft=greedy_draft)
    return tally
