"""A few prompt / response / reward triples of every step, for a person to read: the first thing to look at when
a reward stays at 0 (every response cut at the length cap, or noise, shows at a glance).

    RUN_DIR/samples.jsonl   one JSON object per sample: step, prompt, response, reward, finish_reason, the
                            token ids (prompt_ids, response_ids) a benchmark can score again, and the
                            engine's log-prob of each response token (response_logprobs; null without)
and the same as a text table in the loggers (TensorBoard's TEXT tab, a wandb table), under ``samples``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

from megatron_tlt.atomic_files import drop_steps_after

SAMPLES_FILE = "samples.jsonl"


def pick(samples: Sequence, count: int) -> list:
    """``count`` samples, spread over prompts: the first response of each prompt, then the second, ..."""
    return sorted(samples, key=lambda s: (s.sample_index, s.prompt_index))[:count]


def sample_records(step: int, samples: Sequence, decode: Callable[[Sequence[int]], str], count: int) -> list[dict]:
    return [{"step": step, "prompt": decode(s.prompt_ids), "response": decode(s.response_ids),
             "reward": s.reward, "finish_reason": s.finish_reason, "response_tokens": len(s.response_ids),
             "prompt_ids": list(s.prompt_ids), "response_ids": list(s.response_ids),
             "response_logprobs": s.rollout_logprobs} for s in pick(samples, count)]


def as_markdown(records: Sequence[dict]) -> str:
    """The records as one Markdown table (what TensorBoard's text plugin renders)."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", "<br>")

    rows = [f"| {cell(r['prompt'])} | {cell(r['response'])} | {r['reward']:.3g} | {r['response_tokens']} "
            f"({r['finish_reason']}) |" for r in records]
    return "\n".join(["| prompt | response | reward | tokens |", "|---|---|---|---|", *rows])


def append(run_dir: Path, records: Sequence[dict]) -> None:
    with open(run_dir / SAMPLES_FILE, "a") as out:
        for record in records:
            out.write(json.dumps(record) + "\n")


def truncate(run_dir: Path, last_step: int) -> None:
    """Drop what a killed run wrote past the checkpoint it resumes from."""
    drop_steps_after(run_dir / SAMPLES_FILE, last_step)


def read(run_dir: Path) -> list[dict]:
    path = run_dir / SAMPLES_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.is_file() else []
