"""Prompt datasets for RL: load the rows RL users already have, count and skip bad ones.

Accepted files (chosen by suffix):
  ``.jsonl`` / ``.ndjson``  one JSON object per line; blank lines are ignored;
  ``.json``                 a JSON array of objects, or JSON lines under a ``.json`` name (as HF datasets writes);
  ``.parquet``              VeRL's format; needs ``pyarrow``.
A row holds a prompt, either plain text or a list of chat messages (``{"role", "content"}``, rendered with
the tokenizer's chat template and a generation prompt), and a ground truth, either VeRL's nested
``reward_model: {"ground_truth": ...}`` or a flat ``ground_truth`` / ``answer`` key; ``PromptDataConfig``
renames the keys. Rows that cannot be used are counted by reason in a ``DataReport``, logged as one
warning line and skipped; they are never dropped silently, and a file with no usable row is an error.
Which prompts each DP rank takes per step is ``rl/inputs/sampler.py``'s job.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path

from megatron_tlt.formats.tokenizer import Tokenizer, TokenizerError

logger = logging.getLogger(__name__)

# Why a row was skipped. Row numbers in reports are 1-based: the line number in JSON lines files
# (what an editor shows), the row position in JSON arrays and Parquet files.
SKIP_REASONS = (
    "invalid_json",  # a JSON lines line that does not parse
    "not_an_object",  # the row is not a JSON object / struct
    "missing_prompt",  # no prompt key, or null
    "empty_prompt",  # blank text, no messages, or only blank message contents
    "bad_messages",  # prompt neither text nor a message list, a malformed message, or the template rejected it
    "missing_ground_truth",  # none of the ground-truth keys holds a value, or the value is blank
    "bad_ground_truth",  # the ground truth is not text or a number
    "prompt_too_long",  # more than max_prompt_tokens tokens after rendering
)
MAX_BAD_ROWS_SHOWN = 5
_PARQUET_BATCH_ROWS = 4096


class DataError(ValueError):
    """A prompt file that is missing, unreadable, of an unknown format, or holds no usable row."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PromptDataConfig:
    """Where a row keeps its prompt, ground truth and source, and how long a prompt may be: the ``data.*`` keys of
    the same names (``from_config``)."""

    prompt_key: str = "prompt"
    ground_truth_keys: tuple[str, ...] = ("reward_model.ground_truth", "ground_truth", "answer")
    data_source_key: str = "data_source"
    max_prompt_tokens: int = 1024
    add_bos_to_text: bool = True

    def __post_init__(self):
        # a list from YAML; kept a tuple so the frozen config hashes
        object.__setattr__(self, "ground_truth_keys", tuple(self.ground_truth_keys))
        if not self.ground_truth_keys:
            raise ValueError("data.ground_truth_keys is empty: name at least one key, e.g. [answer]")
        if self.max_prompt_tokens < 1:
            raise ValueError(f"data.max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")

    @classmethod
    def from_config(cls, data) -> PromptDataConfig:
        """From the run's ``DataConfig``."""
        return cls(prompt_key=data.prompt_key, ground_truth_keys=data.ground_truth_keys,
                   data_source_key=data.data_source_key, max_prompt_tokens=data.max_prompt_tokens,
                   add_bos_to_text=data.add_bos_to_text)


@dataclasses.dataclass(frozen=True)
class PromptExample:
    """One usable prompt: ``index`` is its position in the loaded dataset (what ``PromptSampler`` yields)."""

    index: int
    prompt_ids: tuple[int, ...]
    ground_truth: str
    data_source: str | None


@dataclasses.dataclass(frozen=True)
class DataReport:
    """What loading a file kept and skipped. ``first_bad_rows`` holds up to MAX_BAD_ROWS_SHOWN 1-based row
    numbers per reason; ``skipped`` counts every skipped row by reason (reasons with no rows are absent)."""

    path: Path
    num_rows: int
    num_kept: int
    skipped: dict[str, int]
    first_bad_rows: dict[str, tuple[int, ...]]

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())

    def summary(self) -> str:
        """One line: kept and skipped counts, with the first offending rows of each reason."""
        line = f"{self.path}: kept {self.num_kept} of {self.num_rows} rows"
        if not self.skipped:
            return line
        parts = []
        for reason, count in self.skipped.items():
            rows = self.first_bad_rows[reason]
            more = ", ..." if count > len(rows) else ""
            parts.append(f"{reason} {count} (row{'s' if count > 1 else ''} {', '.join(map(str, rows))}{more})")
        return f"{line}; skipped {self.num_skipped}: " + "; ".join(parts)


@dataclasses.dataclass(frozen=True)
class PromptDataset:
    """The usable prompts of one file, in file order, and the report of what was skipped."""

    path: Path
    examples: tuple[PromptExample, ...]
    report: DataReport

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> PromptExample:
        return self.examples[index]

    def gather(self, indices: Sequence[int]) -> list[PromptExample]:
        """The examples at ``indices`` (a batch from ``PromptSampler``), in that order."""
        return [self.examples[i] for i in indices]


class _BadRow(Exception):
    """Internal: this row is skipped for ``reason``."""

    def __init__(self, reason: str):
        assert reason in SKIP_REASONS, reason
        self.reason = reason


_INVALID_JSON = object()  # stands in for a JSON lines row that did not parse


def _iter_json_lines(lines: Iterator[bytes]) -> Iterator[tuple[int, object]]:
    for line_number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            yield line_number, json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            yield line_number, _INVALID_JSON


def _iter_json_file_lines(path: Path) -> Iterator[tuple[int, object]]:
    with path.open("rb") as lines:  # streamed: a large file is never held whole
        yield from _iter_json_lines(lines)


def _iter_parquet(path: Path) -> Iterator[tuple[int, object]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    row_number = 0
    try:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=_PARQUET_BATCH_ROWS):
            for row in batch.to_pylist():
                row_number += 1
                yield row_number, row
    except (pa.ArrowException, OSError) as err:
        raise DataError(f"{path}: unreadable Parquet file ({' '.join(str(err).split())})") from None


def _read_rows(path: Path) -> Iterator[tuple[int, object]]:
    """(1-based row number, parsed row) pairs; format errors about the whole file raise DataError now."""
    if not path.is_file():
        raise DataError(f"{path}: prompt file does not exist")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        try:
            import pyarrow.parquet  # noqa: F401
        except ImportError:
            raise DataError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
        return _iter_parquet(path)
    if suffix in (".jsonl", ".ndjson"):
        return _iter_json_file_lines(path)
    if suffix != ".json":
        raise DataError(f"{path}: unknown prompt file format {suffix!r}; use .jsonl, .json or .parquet")
    data = path.read_bytes()
    if data.lstrip()[:1] != b"[":
        return _iter_json_lines(iter(data.splitlines()))
    try:
        rows = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DataError(f"{path}: not a valid JSON array ({err})") from None
    return iter(enumerate(rows, start=1))


def _lookup(row: dict, key: str) -> object:
    if key in row:
        return row[key]
    value: object = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def _ground_truth(row: dict, keys: tuple[str, ...]) -> str:
    value = next((v for v in (_lookup(row, k) for k in keys) if v is not None), None)
    if value is None:
        raise _BadRow("missing_ground_truth")
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise _BadRow("bad_ground_truth")
    text = str(value)
    if not text.strip():
        raise _BadRow("missing_ground_truth")
    return text


def _check_messages(prompt: list) -> list[dict]:
    if not prompt:
        raise _BadRow("empty_prompt")
    for message in prompt:
        if not isinstance(message, dict):
            raise _BadRow("bad_messages")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role or not isinstance(content, str):
            raise _BadRow("bad_messages")
    if not any(message["content"].strip() for message in prompt):
        raise _BadRow("empty_prompt")
    return [dict(message) for message in prompt]


def _prompt(row: dict, config: PromptDataConfig) -> str | list[dict]:
    prompt = row.get(config.prompt_key)
    if prompt is None:
        raise _BadRow("missing_prompt")
    if isinstance(prompt, str):
        if not prompt.strip():
            raise _BadRow("empty_prompt")
        return prompt
    if isinstance(prompt, list):
        return _check_messages(prompt)
    raise _BadRow("bad_messages")


def _prompt_ids(prompt: str | list[dict], row_number: int, path: Path, tokenizer: Tokenizer,
                config: PromptDataConfig) -> list[int]:
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt, add_bos=config.add_bos_to_text)
    else:
        if tokenizer.chat_template is None:
            # A setup error, not a bad row: every chat row would fail the same way.
            raise DataError(
                f"{path}: row {row_number} has chat messages but the tokenizer in {tokenizer.directory} has no "
                "chat template (add chat_template.jinja or a chat_template entry in tokenizer_config.json)"
            )
        try:
            text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True)
        except TokenizerError:  # the template refused this chat (raise_exception), e.g. roles out of order
            raise _BadRow("bad_messages") from None
        ids = tokenizer.encode(text)
    if len(ids) > config.max_prompt_tokens:
        raise _BadRow("prompt_too_long")
    return ids


def load_prompt_dataset(
    path: str | Path, tokenizer: Tokenizer, config: PromptDataConfig | None = None
) -> PromptDataset:
    """Read, validate and tokenize every row of ``path``; bad rows are counted, logged and skipped.

    Raises DataError when the file is missing, unreadable or of an unknown format, when chat rows meet a
    tokenizer without a chat template, or when no row is usable.
    """
    path = Path(path)
    config = config or PromptDataConfig()
    examples: list[PromptExample] = []
    skipped: dict[str, int] = {}
    first_bad_rows: dict[str, list[int]] = {}
    num_rows = 0
    for row_number, row in _read_rows(path):
        num_rows += 1
        try:
            if row is _INVALID_JSON:
                raise _BadRow("invalid_json")
            if not isinstance(row, dict):
                raise _BadRow("not_an_object")
            # Cheap checks first; tokenizing comes last, so a row is counted once, under its first problem.
            prompt = _prompt(row, config)
            ground_truth = _ground_truth(row, config.ground_truth_keys)
            prompt_ids = _prompt_ids(prompt, row_number, path, tokenizer, config)
        except _BadRow as bad:
            skipped[bad.reason] = skipped.get(bad.reason, 0) + 1
            rows = first_bad_rows.setdefault(bad.reason, [])
            if len(rows) < MAX_BAD_ROWS_SHOWN:
                rows.append(row_number)
            continue
        source = _lookup(row, config.data_source_key)
        examples.append(PromptExample(
            index=len(examples),
            prompt_ids=tuple(prompt_ids),
            ground_truth=ground_truth,
            data_source=None if source is None else str(source),
        ))
    report = DataReport(
        path=path,
        num_rows=num_rows,
        num_kept=len(examples),
        skipped={reason: skipped[reason] for reason in SKIP_REASONS if reason in skipped},
        first_bad_rows={reason: tuple(rows) for reason, rows in first_bad_rows.items()},
    )
    if num_rows == 0:
        raise DataError(f"{path}: prompt file has no rows")
    if not examples:
        raise DataError(f"no usable prompt rows in {report.summary()}")
    if report.skipped:
        logger.warning("skipped bad prompt rows: %s", report.summary())
    return PromptDataset(path=path, examples=tuple(examples), report=report)
