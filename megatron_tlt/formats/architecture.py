"""The policy architecture, read from a Hugging Face ``config.json``.

Only what the Megatron-Core model and the weight maps need is kept, in one frozen dataclass, so the
rest of the code never touches raw HF dictionaries. Supported families: Llama-3.x
(``LlamaForCausalLM``) and Qwen2/Qwen2.5 (``Qwen2ForCausalLM``, which adds a bias to q/k/v), named by the
config's ``architectures`` list or, in configs without one, by its ``model_type`` (``llama``, ``qwen2``).

It sits in ``formats/`` because both sides read it: the converters and checkpoint files of this package
(``weights.py``, ``policy_meta.py``) and the model built from it (``model/``), which reads ``formats/``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path
from typing import Any

from megatron_tlt import layout_rules

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
}

# ``model_type`` -> the class, for configs that name no ``architectures`` (GGUF conversions and some
# fine-tuning exports write none).
ARCHITECTURE_OF_MODEL_TYPE = {family: architecture for architecture, family in SUPPORTED_ARCHITECTURES.items()}

logger = logging.getLogger(__name__)

# Megatron pads the vocabulary so every tensor-parallel shard of the embedding has the same rows.
VOCAB_PAD_MULTIPLE = 128


class ModelConfigError(ValueError):
    """A config.json we cannot (or must not) turn into a Megatron model."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Llama-3 frequency-dependent RoPE scaling (``rope_type: llama3``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class PolicyArchitecture:
    """Shape and flavour of a Llama/Qwen2 decoder, independent of how it is parallelised."""

    family: str
    """``llama`` or ``qwen2``."""
    architecture: str
    """The HF class name, written back on export."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    hf_config: dict[str, Any] = dataclasses.field(repr=False, compare=False)
    """The original config.json, kept verbatim so the export writes it back unchanged (but for an
    ``architectures`` list, added where it had none)."""

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_kv_heads

    def padded_vocab_size(self, tensor_parallel_size: int) -> int:
        multiple = VOCAB_PAD_MULTIPLE * tensor_parallel_size
        return math.ceil(self.vocab_size / multiple) * multiple

    def validate_layout(self, *, tensor_parallel_size: int, pipeline_parallel_size: int) -> None:
        """Refuse parallel layouts this model cannot be split into, naming the values: the rule book's
        ``layout_rules.check_policy_layout``, raised as the ``ModelConfigError`` this method's callers catch."""
        try:
            layout_rules.check_policy_layout(self, tp=tensor_parallel_size, pp=pipeline_parallel_size)
        except layout_rules.LayoutError as err:
            raise ModelConfigError(str(err)) from None


def _require(cfg: dict[str, Any], key: str, source: str) -> Any:
    if key not in cfg:
        raise ModelConfigError(f"{source}: missing required key '{key}'")
    return cfg[key]


def _parse_rope_scaling(raw: dict[str, Any] | None, source: str) -> RopeScaling | None:
    if not raw:
        return None
    rope_type = raw.get("rope_type", raw.get("type"))
    if rope_type == "default":
        return None
    if rope_type != "llama3":
        raise ModelConfigError(f"{source}: unsupported rope_scaling type '{rope_type}' (supported: llama3)")
    return RopeScaling(
        factor=float(raw["factor"]),
        low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
        high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(raw.get("original_max_position_embeddings", 8192)),
    )


def _supported_architecture(cfg: dict[str, Any], source: str) -> str:
    """The HF class of ``cfg``: the first supported entry of ``architectures`` or, where the list is absent,
    the class of its ``model_type``."""
    architectures = cfg.get("architectures") or []
    if architectures:
        known = [a for a in architectures if a in SUPPORTED_ARCHITECTURES]
        if not known:
            raise ModelConfigError(f"{source}: unsupported architecture {architectures!r}; "
                                   f"supported: {sorted(SUPPORTED_ARCHITECTURES)}")
        return known[0]
    model_type = cfg.get("model_type")
    if model_type not in ARCHITECTURE_OF_MODEL_TYPE:
        raise ModelConfigError(
            f"{source}: no 'architectures' list, and model_type {model_type!r} is not one we support; supported: "
            f"model_type {sorted(ARCHITECTURE_OF_MODEL_TYPE)} (architectures {sorted(SUPPORTED_ARCHITECTURES)})")
    architecture = ARCHITECTURE_OF_MODEL_TYPE[model_type]
    logger.info("%s: no 'architectures' list; model_type '%s' read as %s", source, model_type, architecture)
    return architecture


def architecture_from_dict(cfg: dict[str, Any], source: str = "config.json") -> PolicyArchitecture:
    """The architecture of a config.json's contents. Its ``hf_config`` always names ``architectures`` (read
    from ``model_type`` where the config has no such list), so every config.json written from it does too."""
    architecture = _supported_architecture(cfg, source)
    family = SUPPORTED_ARCHITECTURES[architecture]
    hidden = int(_require(cfg, "hidden_size", source))
    heads = int(_require(cfg, "num_attention_heads", source))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise ModelConfigError(
            f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
        )
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelConfigError(f"{source}: unsupported hidden_act '{cfg['hidden_act']}' (supported: silu)")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ModelConfigError(f"{source}: attention_bias/mlp_bias are not supported for {architecture}")
    rope_parameters = cfg.get("rope_parameters") or {}  # transformers >= 5 nests RoPE settings here
    rope_theta = float(cfg.get("rope_theta", rope_parameters.get("rope_theta", 10000.0)))
    rope_scaling_raw = cfg.get("rope_scaling") or (rope_parameters if "factor" in rope_parameters else None)
    return PolicyArchitecture(
        family=family,
        architecture=architecture,
        vocab_size=int(_require(cfg, "vocab_size", source)),
        hidden_size=hidden,
        intermediate_size=int(_require(cfg, "intermediate_size", source)),
        num_layers=int(_require(cfg, "num_hidden_layers", source)),
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=_parse_rope_scaling(rope_scaling_raw, source),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=family == "qwen2",
        hf_config=dict(cfg) if cfg.get("architectures") else dict(cfg, architectures=[architecture]),
    )


def load_architecture(model_dir: str | Path) -> PolicyArchitecture:
    """Read ``config.json`` from an HF model directory."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelConfigError(f"{path}: not found (expected an HF model directory)")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ModelConfigError(f"{path}: not valid JSON ({err})") from None
    return architecture_from_dict(cfg, source=str(path))
