"""The EAGLE-1 drafter: exactly the function vLLM 0.32's EagleLlamaForCausalLM serves, as a plain module.

    out = layer(fc(cat(embed(x_{t+1}), f_t)))        layer = Llama decoder layer without its input norm
    draft logits = lm_head(out)                        the policy's LM head, no norm before it

``f_t`` is the policy's post-final-norm hidden state at position t. The embedding and the LM head are the
policy's and change every RL step, so they are inputs here (``token_embeds``) or arguments of the loss,
never parameters: ``state_dict()`` holds exactly the tensors of ``spec.eagle.expected_drafter_shapes``, under
vLLM's names, and nothing else (DESIGN.md section 4, trap 2).

Shape suffixes: ``t`` = packed tokens of one or more sequences, ``h`` = hidden size, ``d`` = head dim.
Sequences are packed along ``t``: ``segment_ids_t`` says which sequence a row belongs to and attention never
crosses a segment; ``position_ids_t`` is each row's position in its own sequence (RoPE).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from megatron_tlt.drafter.precision import convert_to_fp8, make_linear
from megatron_tlt.formats.architecture import PolicyArchitecture
from megatron_tlt.spec.eagle import DrafterMismatch, eagle_drafter_config, validate_drafter

# Llama's initializer_range: the scale of every random weight at initialisation.
_INIT_STD = 0.02
# Transformer Engine layers keep their FP8 scaling state under this key; it is not a drafter tensor.
_TE_EXTRA_STATE = "_extra_state"


def policy_rope_inv_freq(arch: PolicyArchitecture) -> tuple[torch.Tensor, float]:
    """The policy's RoPE inverse frequencies [head_dim / 2] (float32) and cos/sin scale, built by transformers.

    Going through transformers' own initialisers (default and Llama-3 scaling) keeps the drafter's rotary
    embedding identical to the policy's instead of re-deriving the scaling rules here.
    """
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig.from_dict(eagle_drafter_config(arch))
    rope_type, theta = config.rope_parameters["rope_type"], float(config.rope_parameters["rope_theta"])
    # The Megatron policy is built from `arch`; refuse a config transformers reads differently.
    if (rope_type == "llama3") != (arch.rope_scaling is not None) or theta != arch.rope_theta:
        raise ValueError(f"transformers reads RoPE as {rope_type} with theta {theta}, the policy has "
                         f"rope_scaling={arch.rope_scaling} and theta {arch.rope_theta}")
    if rope_type == "default":
        init = LlamaRotaryEmbedding.compute_default_rope_parameters
    else:
        init = ROPE_INIT_FUNCTIONS[rope_type]
    inv_freq, attention_scaling = init(config)
    if inv_freq.numel() * 2 != arch.head_dim:
        raise ValueError(f"RoPE frequencies cover {inv_freq.numel() * 2} dims, "
                         f"the policy's head_dim is {arch.head_dim}")
    return inv_freq.float(), float(attention_scaling)


def index_in_segment(segment_ids_t: torch.Tensor) -> torch.Tensor:
    """Each row's index within its own segment (segments are contiguous runs of rows)."""
    rows_t = torch.arange(segment_ids_t.numel(), device=segment_ids_t.device)
    starts_segment_t = torch.ones_like(segment_ids_t, dtype=torch.bool)
    starts_segment_t[1:] = segment_ids_t[1:] != segment_ids_t[:-1]
    segment_start_t = torch.cummax(torch.where(starts_segment_t, rows_t, 0), dim=0).values
    return rows_t - segment_start_t


def draft_step_masks(segment_ids_t: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """For each draft step k = 1..``steps``, a [t, k * t] bool mask: what row s may attend to at that step, over
    the rows of steps 1..k side by side, as vLLM's drafter attends.

    At step k the row s drafts k - 1 positions past the last token the target verified: it sees that prefix,
    which is step 1's rows j <= s - (k - 1) (made from the policy's own features), and the chain of drafts
    since, which is step m's row s - (k - m) for m = 2..k (itself at m = k); never another segment. Step 1's
    mask is block-causal. Causality is by row order, so each segment's rows must be contiguous and in
    sequence order.
    """
    rows_t = torch.arange(segment_ids_t.numel(), device=segment_ids_t.device)
    same_segment_tt = segment_ids_t[:, None] == segment_ids_t[None, :]
    behind_tt = rows_t[:, None] - rows_t[None, :]  # s - j
    # Row s - d of one later step, d = 0 .. steps - 2: made once, shared by every step's chain.
    chain_row = [same_segment_tt & (behind_tt == d) for d in range(steps - 1)]
    masks = []
    for k in range(1, steps + 1):
        prefix_tt = torch.tril(same_segment_tt, diagonal=1 - k)  # step 1's rows j <= s - (k - 1)
        drafts = [chain_row[k - m] for m in range(2, k + 1)]  # step m's row s - (k - m)
        masks.append(torch.cat([prefix_tt, *drafts], dim=1))
    return masks


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class RMSNorm(nn.Module):
    """Llama RMSNorm, computed in float32 as transformers and vLLM do, whatever the weight dtype."""

    def __init__(self, hidden_size: int, eps: float, *, dtype: torch.dtype, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))

    def forward(self, x_th: torch.Tensor) -> torch.Tensor:
        x32 = x_th.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x_th.dtype)


class EagleAttention(nn.Module):
    """Grouped-query self-attention with RoPE (neox layout, as Llama); q/k/v bias only for Qwen2 policies."""

    def __init__(self, arch: PolicyArchitecture, *, dtype: torch.dtype, device=None,
                 fp8_backend: str | None = None):
        super().__init__()
        h, d = arch.hidden_size, arch.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_attention_heads, arch.num_kv_heads, d
        factory = dict(dtype=dtype, device=device, fp8_backend=fp8_backend)
        self.q_proj = make_linear(h, self.num_heads * d, bias=arch.qkv_bias, **factory)
        self.k_proj = make_linear(h, self.num_kv_heads * d, bias=arch.qkv_bias, **factory)
        self.v_proj = make_linear(h, self.num_kv_heads * d, bias=arch.qkv_bias, **factory)
        self.o_proj = make_linear(self.num_heads * d, h, bias=False, **factory)

    def forward(self, x_th, cos_td, sin_td, mask_tt, kv_cache: list | None = None) -> torch.Tensor:
        """``kv_cache``: the keys and values of earlier draft steps' rows (``EagleDrafter.unroll``); these
        rows' own are appended, and ``mask_tt`` spans all of them, earliest step first."""
        t = x_th.shape[0]
        q = self.q_proj(x_th).view(t, self.num_heads, self.head_dim).transpose(0, 1)  # [heads, t, d]
        k = self.k_proj(x_th).view(t, self.num_kv_heads, self.head_dim).transpose(0, 1)
        v = self.v_proj(x_th).view(t, self.num_kv_heads, self.head_dim).transpose(0, 1)
        q = q * cos_td + _rotate_half(q) * sin_td
        k = k * cos_td + _rotate_half(k) * sin_td
        if kv_cache is not None:
            kv_cache.append((k, v))
            k = torch.cat([cached_k for cached_k, _ in kv_cache], dim=1)
            v = torch.cat([cached_v for _, cached_v in kv_cache], dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_tt, enable_gqa=True)
        return self.o_proj(out.transpose(0, 1).reshape(t, self.num_heads * self.head_dim))


class SwiGLU(nn.Module):
    def __init__(self, arch: PolicyArchitecture, *, dtype: torch.dtype, device=None,
                 fp8_backend: str | None = None):
        super().__init__()
        h, inter = arch.hidden_size, arch.intermediate_size
        factory = dict(bias=False, dtype=dtype, device=device, fp8_backend=fp8_backend)
        self.gate_proj = make_linear(h, inter, **factory)
        self.up_proj = make_linear(h, inter, **factory)
        self.down_proj = make_linear(inter, h, **factory)

    def forward(self, x_th: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x_th)) * self.up_proj(x_th))


class EagleDecoderLayer(nn.Module):
    """A Llama decoder layer whose first input norm is removed, as vLLM's EAGLE layer (``layers.0``)."""

    def __init__(self, arch: PolicyArchitecture, *, dtype: torch.dtype, device=None,
                 fp8_backend: str | None = None):
        super().__init__()
        self.self_attn = EagleAttention(arch, dtype=dtype, device=device, fp8_backend=fp8_backend)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype=dtype, device=device)
        self.mlp = SwiGLU(arch, dtype=dtype, device=device, fp8_backend=fp8_backend)

    def forward(self, x_th, cos_td, sin_td, mask_tt, kv_cache: list | None = None) -> torch.Tensor:
        # No input norm: attention reads fc's output directly (vLLM replaces input_layernorm by Identity).
        x_th = x_th + self.self_attn(x_th, cos_td, sin_td, mask_tt, kv_cache)
        return x_th + self.mlp(self.post_attention_layernorm(x_th))


class EagleDrafter(nn.Module):
    """One-layer EAGLE-1 drafter for a policy; parameters named as vLLM loads them.

    Initialisation (``seed`` makes it identical on every rank without communication): every linear weight
    ~ N(0, 0.02), biases 0, the norm weight 1, and the feature half of ``fc`` set to the identity
    (``fc = [N(0, 0.02) | I]``). The drafter then starts close to "copy the feature": its output has the
    scale of a post-norm hidden state (so SmoothL1 starts small and stable), its first drafts are the policy's
    distribution at f_t (one step behind, not noise), and every weight still gets a gradient from the first
    step (no zero-initialised projection blocks the ones before it).
    """

    def __init__(self, arch: PolicyArchitecture, *, dtype: torch.dtype = torch.float32, device=None, seed: int = 0,
                 fp8_backend: str | None = None):
        super().__init__()
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"drafter dtype must be torch.float32 or torch.bfloat16, got {dtype}")
        self.arch = arch
        h = arch.hidden_size
        self.fc = make_linear(2 * h, h, bias=False, dtype=dtype, device=device, fp8_backend=fp8_backend)
        self.layers = nn.ModuleList([EagleDecoderLayer(arch, dtype=dtype, device=device, fp8_backend=fp8_backend)])
        inv_freq, self.rope_attention_scaling = policy_rope_inv_freq(arch)
        self._rope_inv_freq_fp32 = inv_freq  # source of truth, never cast (see _apply)
        self.register_buffer("rope_inv_freq", inv_freq.to(device), persistent=False)
        self.reset_parameters(seed)
        convert_to_fp8(self, fp8_backend)  # torchao's layers: the same parameters, FP8 GEMMs

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """The initialisation described in the class docstring, from a private generator."""
        generator = torch.Generator().manual_seed(seed)
        h = self.arch.hidden_size
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * _INIT_STD)
        self.fc.weight[:, h:].copy_(torch.eye(h))

    def _apply(self, fn, recurse=True):
        # .to(torch.bfloat16) would round the RoPE frequencies too; keep them float32 on the new device.
        super()._apply(fn, recurse)
        self.rope_inv_freq = self._rope_inv_freq_fp32.to(self.rope_inv_freq.device)
        return self

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def rotary_cos_sin(self, position_ids_t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [1, t, head_dim] for RoPE, computed in float32 and cast like transformers does."""
        freqs = position_ids_t.float()[:, None] * self.rope_inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        scale = self.rope_attention_scaling
        return (angles.cos() * scale).to(dtype)[None], (angles.sin() * scale).to(dtype)[None]

    def forward(self, token_embeds_th: torch.Tensor, features_th: torch.Tensor, position_ids_t: torch.Tensor,
                segment_ids_t: torch.Tensor) -> torch.Tensor:
        """Drafted next features [t, h] for packed examples.

        Args:
            token_embeds_th: the policy's embedding of token x_{t+1} for each row (current embedding weights).
            features_th: the policy's post-final-norm hidden state f_t for each row.
            position_ids_t: position t of each row within its own sequence.
            segment_ids_t: which packed segment each row belongs to; segments are contiguous runs of rows.
        Returns:
            The drafter's output: its prediction of f_{t+1}; ``lm_head(out)`` drafts token x_{t+2}.
        """
        return self.unroll(token_embeds_th, features_th, position_ids_t, segment_ids_t, steps=1)[0][0]

    def unroll(self, token_embeds_th: torch.Tensor, features_th: torch.Tensor, position_ids_t: torch.Tensor,
               segment_ids_t: torch.Tensor, steps: int, after_step: Callable[[], None] = lambda: None,
               ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The drafter's predictions at draft steps 1..``steps`` for every row, computed as vLLM drafts them
        (training-time test, as EAGLE-3 and HASS train): step 1 is ``forward``; at step k row s reads, in
        place of the policy's feature f_s, the drafter's own step k-1 output at row s-1 (its prediction of
        f_s), and attends as ``draft_step_masks`` says. Every step predicts the same targets f_{s+1}.

        Returns ``(predictions, valid)``: per step a [t, h] prediction and a [t] bool that is False for the
        first k-1 rows of each segment (no draft chain that long starts inside the segment). ``after_step`` is
        called after each step (the spot trainer's preemption point: it may raise to abandon the pass).
        """
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        if token_embeds_th.shape != features_th.shape or token_embeds_th.dim() != 2:
            raise ValueError(f"token_embeds_th {tuple(token_embeds_th.shape)} and features_th "
                             f"{tuple(features_th.shape)} must both be [tokens, hidden]")
        rows_in_segment_t = index_in_segment(segment_ids_t)
        masks = draft_step_masks(segment_ids_t, steps)
        kv_cache: list = []
        predictions, valid = [], []
        step_features_th = features_th
        for step in range(1, steps + 1):
            if step > 1:  # row s reads row s-1's previous prediction; row 0's input is a placeholder (invalid)
                step_features_th = torch.cat((step_features_th[:1].to(predictions[-1].dtype), predictions[-1][:-1]))
            fused_th = self.fc(torch.cat((token_embeds_th, step_features_th), dim=-1).to(self.dtype))  # embedding first
            if step == 1:
                cos, sin = self.rotary_cos_sin(position_ids_t, fused_th.dtype)
            predictions.append(self.layers[0](fused_th, cos, sin, masks[step - 1], kv_cache))
            valid.append(rows_in_segment_t >= step - 1)
            after_step()
        return predictions, valid

    # -- tensors in vLLM's format -----------------------------------------------------------------------

    @classmethod
    def from_tensors(cls, arch: PolicyArchitecture, tensors: dict[str, torch.Tensor], *,
                     dtype: torch.dtype = torch.float32, device=None) -> EagleDrafter:
        """A drafter holding ``tensors`` (vLLM names, as ``export_tensors`` writes them)."""
        drafter = cls(arch, dtype=dtype, device=device)
        drafter.load_tensors(tensors)
        return drafter

    @torch.no_grad()
    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy vLLM-named drafter tensors into this module (cast to its dtype and device).

        The tensors are validated against the policy first (``DrafterMismatch`` names the problem). An
        ``embed_tokens.weight`` that a drafter file may carry is ignored: this drafter always drafts with
        the policy's current embedding.
        """
        validate_drafter(self.arch, tensors)
        result = self.load_state_dict({k: v for k, v in tensors.items() if k != "embed_tokens.weight"}, strict=False)
        missing = [k for k in result.missing_keys if not k.endswith(_TE_EXTRA_STATE)]
        if missing or result.unexpected_keys:
            raise DrafterMismatch(f"drafter tensors do not fit: missing {missing}, unexpected {result.unexpected_keys}")

    @torch.no_grad()
    def export_tensors(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Detached CPU copies of every drafter tensor under vLLM's names (no embedding, no LM head)."""
        return {name: t.detach().to("cpu", dtype=dtype or t.dtype, copy=True) for name, t in self.state_dict().items()
                if not name.endswith(_TE_EXTRA_STATE)}
