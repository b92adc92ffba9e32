"""Bring your own model (issue 41): a small pretrained-style instruct checkpoint of the Llama family, as users
bring one, through every command, as users run them: `tlt convert` both ways, `tlt train` on chat-message
prompts with the exact-match reward (`--config hf`, the pretrained model's settings: 2 steps, one rank, the
drafter cold-started on the policy's responses and trained on idle ranks), `tlt convert mcore-to-hf` and
`tlt export-drafter` of the run, then the two exports served by plain vLLM with the policy's own tokenizer and
chat template, and loaded by transformers.

The model (``tiny_models.make_tiny_chat_model``) has what the issue's checkpoint had: tied embeddings, a chat
template in tokenizer_config.json, a tokenizer.json, and a config.json with ``model_type`` but no
``architectures``.
"""

import json
import os
import subprocess

import pytest
import torch
from hang_guard import HANG_GUARD_S

from megatron_tlt.formats.hf_io import HFCheckpointReader

TRAIN = ["--config", "hf", "parallel.data_parallel_size=1", "trainer.steps=2", "trainer.save_every=1",
         "trainer.prompts_per_step=4", "rollout.samples_per_prompt=2", "rollout.max_response_tokens=16",
         "trainer.eval_every=0", "data.reward=exact_match", "drafter.depth=2"]
SERVED_MESSAGES = [{"role": "user", "content": "Q: 12+7-3=?\nA:"}]


def _tlt(env, *args):
    result = subprocess.run(["tlt", *args], env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return dict(os.environ, TLT_CACHE_DIR=str(tmp_path_factory.mktemp("tlt-cache")))


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """(the HF model directory, a JSONL of chat-message prompts with their answers, a held-out JSONL of others)."""
    from tiny_models import make_tiny_chat_model
    from megatron_tlt.rl.tiny import synthetic_task

    root = tmp_path_factory.mktemp("byo")
    problems = synthetic_task.generate_problems(200, seed=5)
    hf_dir = make_tiny_chat_model(root / "hf", [p.prompt + p.solution for p in problems], seed=4)
    data, held_out = root / "chat.jsonl", root / "held_out.jsonl"
    for path, chosen in ((data, problems[:8]), (held_out, problems[8:12])):
        path.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": p.prompt}], "answer": p.answer})
                                + "\n" for p in chosen))
    return hf_dir, data, held_out


@pytest.fixture(scope="module")
def trained(env, chat_model, tmp_path_factory):
    """The run, and its two exports: (run directory, exported policy, exported drafter)."""
    hf_dir, data, held_out = chat_model
    root = tmp_path_factory.mktemp("byo-run")
    run_dir, policy_dir, drafter_dir = root / "run", root / "policy-hf", root / "drafter-vllm"
    _tlt(env, "train", *TRAIN, f"model.hf_dir={hf_dir}", f"data.path={data}", f"data.held_out_path={held_out}",
         f"trainer.run_dir={run_dir}")
    _tlt(env, "convert", "mcore-to-hf", "--ckpt", str(run_dir), "--out", str(policy_dir))
    _tlt(env, "export-drafter", "--ckpt", str(run_dir), "--out", str(drafter_dir))
    return run_dir, policy_dir, drafter_dir


def test_a_config_with_model_type_only_converts_both_ways_bit_for_bit_with_its_tokenizer(env, chat_model, tmp_path):
    hf_dir, *_ = chat_model
    assert "architectures" not in json.loads((hf_dir / "config.json").read_text())
    ckpt, back = tmp_path / "mcore", tmp_path / "hf"
    _tlt(env, "convert", "hf-to-mcore", "--hf", str(hf_dir), "--out", str(ckpt))
    _tlt(env, "convert", "mcore-to-hf", "--ckpt", str(ckpt), "--out", str(back))
    before, after = HFCheckpointReader(hf_dir), HFCheckpointReader(back)
    assert sorted(before.names()) == sorted(after.names()) and "lm_head.weight" not in after.names()  # tied
    for name in before.names():
        assert torch.equal(before.get(name), after.get(name)), name
    config = json.loads((back / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        assert (back / name).read_bytes() == (hf_dir / name).read_bytes(), name


def test_the_run_trains_on_chat_prompts_and_its_rank_logs_hold_no_traceback(trained):
    run_dir, _, _ = trained
    records = json.loads((run_dir / "summary.json").read_text())
    assert [r["step"] for r in records] == [1, 2] and all(r["num_samples"] == 8 for r in records)
    config = (run_dir / "config.yaml").read_text()
    assert "lr: 1.0e-06" in config and "kl_coef: 0.001" in config  # the hf config's, not the tiny default's
    assert "init_dir: " in config and "init_dir: null" not in config  # the cold start made the first drafter
    log = (run_dir / "logs" / "rank0.log").read_text()
    assert "vLLM engine ready" in log and "Traceback" not in log
    # data.held_out_path: measured before RL and after the last step (trainer.eval_every=0)
    before = json.loads((run_dir / "eval_before_rl.json").read_text())
    assert {"eval/greedy_accuracy", "eval/sampled_accuracy"} <= set(before) & set(records[-1])
    # the configs the run wrote for its engines name the class that model_type stood for
    engine_configs = list((run_dir / "engines").rglob("config.json"))
    assert engine_configs and all(json.loads(p.read_text())["architectures"] == ["LlamaForCausalLM"]
                                  for p in engine_configs)


def test_the_engine_samples_the_tied_policy_every_step_and_the_samples_say_what_it_wrote(trained):
    """The issue-55 layout: a tied policy, an engine started from dummy weights. A random policy earns exact_match's 0
    everywhere, so hf.yaml's equal-reward filter leaves the update no token: the agreement comes from the forward of
    its own over the step's sequences, and must read ~0 all the same."""
    run_dir, _, _ = trained
    for record in json.loads((run_dir / "summary.json").read_text()):
        assert record["equal_reward_groups_dropped"] == 4 and record["update/num_tokens"] == 0
        assert record["rollout/agreement_tokens"] > 0 and abs(record["rollout/prob_error"] - 1.0) < 1e-4
        assert record["rollout/logprob_diff_max"] < 1e-3 and record["rollout/past_bound_share"] == 0.0
    from megatron_tlt.rl.run import samples_log

    samples = samples_log.read(run_dir)
    assert [s["step"] for s in samples] == [1] * 4 + [2] * 4
    assert all(s["prompt"].startswith("<|im_start|>system") and len(s["response_logprobs"]) == s["response_tokens"]
               for s in samples)


def test_the_exported_policy_holds_the_tokenizer_and_chat_template_of_the_policy_it_came_from(chat_model, trained):
    hf_dir, *_ = chat_model
    run_dir, policy_dir, _ = trained
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        assert (run_dir / "checkpoints" / "step_000002" / "policy" / name).is_file(), name
        assert (policy_dir / name).read_bytes() == (hf_dir / name).read_bytes(), name
    config = json.loads((policy_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True


def test_transformers_loads_the_exported_policy_as_it_is_and_renders_the_chat_as_the_run_did(chat_model, trained):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_tlt.formats.tokenizer import load_tokenizer

    hf_dir, *_ = chat_model
    _, policy_dir, _ = trained
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    ours = load_tokenizer(hf_dir)  # what the run rendered its prompts with
    ids = tokenizer.apply_chat_template(SERVED_MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert list(ids) == ours.encode(ours.apply_chat_template(SERVED_MESSAGES))
    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.generate(torch.tensor([list(ids)]), max_new_tokens=4, do_sample=False).shape[1] == len(ids) + 4


def _serve_with_tokenizer_and_drafter(policy_dir: str, drafter_dir: str) -> dict:
    """Plain vLLM as a user serves the exports: the policy with its own tokenizer (no skip_tokenizer_init) and
    chat template, the drafter as its EAGLE draft."""
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    from vllm import LLM, SamplingParams

    llm = LLM(model=policy_dir, dtype="float32", enforce_eager=True, max_model_len=256, disable_log_stats=False,
              speculative_config={"method": "eagle", "model": drafter_dir, "num_speculative_tokens": 2})
    outputs = llm.chat([SERVED_MESSAGES] * 4, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                       use_tqdm=False)
    metrics = {m.name: m for m in llm.get_metrics()}
    return {"prompt_token_ids": list(outputs[0].prompt_token_ids),
            "tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
            "texts": [o.outputs[0].text for o in outputs],
            "drafts": int(metrics["vllm:spec_decode_num_drafts"].value)}


def test_vllm_serves_the_exported_policy_with_its_tokenizer_and_the_exported_drafter_as_its_eagle_draft(chat_model,
                                                                                                      trained):
    from megatron_tlt.formats.tokenizer import load_tokenizer
    from megatron_tlt.launcher import run_on_ranks

    hf_dir, *_ = chat_model
    _, policy_dir, drafter_dir = trained
    served = run_on_ranks(_serve_with_tokenizer_and_drafter, 1, str(policy_dir), str(drafter_dir), isolated=True)[0]
    ours = load_tokenizer(hf_dir)
    assert served["prompt_token_ids"] == ours.encode(ours.apply_chat_template(SERVED_MESSAGES))
    assert served["tokens"] == 4 * 16 and served["drafts"] > 0
    assert all(isinstance(text, str) and text for text in served["texts"])  # detokenized by the policy's tokenizer
