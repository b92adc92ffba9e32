"""Load a tokenizer from a local directory: a Hugging Face ``tokenizer.json`` or a sentencepiece
``tokenizer.model``; and train a tiny sentencepiece model for synthetic tasks.

Nothing here touches the network: files are opened directly with ``tokenizers`` and
``sentencepiece``, never through ``from_pretrained``. Special tokens come from
``tokenizer_config.json`` (then ``special_tokens_map.json``) when present, otherwise from the
sentencepiece model itself. The chat template comes from ``chat_template.jinja``, else from
``tokenizer_config.json``, and is rendered by transformers' own renderer so prompts match what
``AutoTokenizer.apply_chat_template`` would produce.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

import sentencepiece as spm
import tokenizers

TOKENIZER_JSON = "tokenizer.json"
SENTENCEPIECE_MODEL = "tokenizer.model"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# Roles of the special tokens we resolve; the same names are passed to chat templates as
# ``bos_token`` etc., as transformers does.
SPECIAL_ROLES = ("bos", "eos", "pad", "unk")


class TokenizerError(ValueError):
    """A tokenizer directory that is missing, incomplete or corrupt, or a request it cannot serve."""


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())


class _HFBackend:
    """``tokenizers.Tokenizer`` from a ``tokenizer.json``; knows no special-token roles by itself."""

    def __init__(self, path: Path):
        self._tok = tokenizers.Tokenizer.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.default_special_ids: dict[str, int] = {}

    def encode(self, text: str) -> list[int]:
        # Special tokens written in the text (e.g. by a chat template) are still recognised.
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str:
        return self._tok.id_to_token(token_id)


class _SentencePieceBackend:
    """``SentencePieceProcessor`` from a ``tokenizer.model``; its own bos/eos/pad/unk ids are the defaults."""

    def __init__(self, path: Path):
        self._sp = spm.SentencePieceProcessor(model_file=str(path))
        self.vocab_size = self._sp.get_piece_size()
        ids = {"bos": self._sp.bos_id(), "eos": self._sp.eos_id(), "pad": self._sp.pad_id(), "unk": self._sp.unk_id()}
        self.default_special_ids = {role: i for role, i in ids.items() if i >= 0}  # -1 means undefined
        # Sentencepiece encodes "</s>" in text as literal characters; split it out ourselves so a
        # rendered chat prompt tokenizes the way the HF backend (and transformers) would.
        controls = [self._sp.id_to_piece(i) for i in range(self.vocab_size) if self._sp.is_control(i)]
        controls.sort(key=len, reverse=True)
        self._control_re = re.compile("(" + "|".join(map(re.escape, controls)) + ")") if controls else None

    def encode(self, text: str) -> list[int]:
        if self._control_re is None:
            return self._sp.encode(text)
        ids: list[int] = []
        for i, part in enumerate(self._control_re.split(text)):
            if i % 2:  # odd parts are the captured control pieces
                ids.append(self._sp.piece_to_id(part))
            elif part:
                ids.extend(self._sp.encode(part))
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        if skip_special_tokens:
            return self._sp.decode(ids)  # sentencepiece drops control pieces itself
        parts, run = [], []
        for token_id in ids:
            if self._sp.is_control(token_id):
                parts += [self._sp.decode(run), self._sp.id_to_piece(token_id)]
                run = []
            else:
                run.append(token_id)
        parts.append(self._sp.decode(run))
        return "".join(parts)

    def token_to_id(self, token: str) -> int | None:
        token_id = self._sp.piece_to_id(token)
        # piece_to_id answers unk_id for unknown pieces rather than failing.
        return token_id if self._sp.id_to_piece(token_id) == token else None

    def id_to_token(self, token_id: int) -> str:
        return self._sp.id_to_piece(token_id)


class Tokenizer:
    """Text to token ids and back, plus chat rendering, over either backend. Build with ``load_tokenizer``.

    ``bos_id``/``eos_id`` are None when the tokenizer has no such token (Qwen has no BOS);
    ``pad_id`` falls back to ``eos_id`` when no pad token is defined.
    """

    def __init__(
        self,
        backend: _HFBackend | _SentencePieceBackend,
        *,
        directory: Path,
        special_ids: dict[str, int],
        chat_template: str | None,
    ):
        self._backend = backend
        self.directory = directory
        self.chat_template = chat_template
        self._special_ids = special_ids
        self.vocab_size: int = backend.vocab_size
        self.bos_id: int | None = special_ids.get("bos")
        self.eos_id: int | None = special_ids.get("eos")
        self.pad_id: int | None = special_ids.get("pad", self.eos_id)

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        """Token ids of ``text``; no special tokens are added except BOS when ``add_bos`` is set.

        ``add_bos`` is a no-op for tokenizers without a BOS token. Special tokens written in the text
        itself (as chat templates do) are encoded as those tokens.
        """
        ids = self._backend.encode(text)
        if add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; special tokens are rendered as their strings unless skipped."""
        return self._backend.decode([int(i) for i in ids], skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render ``messages`` (``{"role", "content"}`` dicts) to prompt text with the chat template.

        The template sees ``bos_token``/``eos_token``/``pad_token``/``unk_token`` as transformers
        passes them. Raises TokenizerError when there is no template or the template rejects the chat.
        """
        if self.chat_template is None:
            raise TokenizerError(
                f"{self.directory}: tokenizer has no chat template "
                f"(add {CHAT_TEMPLATE_FILE} or a chat_template entry in {TOKENIZER_CONFIG})"
            )
        # Imported here: transformers takes seconds to import and only chat rendering needs it.
        import jinja2
        from transformers.utils.chat_template_utils import render_jinja_template

        special_tokens = {f"{role}_token": self._backend.id_to_token(i) for role, i in self._special_ids.items()}
        try:
            rendered, _ = render_jinja_template(
                [messages],
                chat_template=self.chat_template,
                add_generation_prompt=add_generation_prompt,
                **special_tokens,
            )
        except jinja2.TemplateError as err:
            raise TokenizerError(f"{self.directory}: chat template failed: {_one_line(err)}") from None
        return rendered[0]


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise TokenizerError(f"{path.parent}: corrupt {path.name} ({_one_line(err)})") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path.parent}: corrupt {path.name} (expected a JSON object)")
    return data


def _token_content(value: object) -> str | None:
    # tokenizer_config.json writes a token either as a string or as a serialised AddedToken dict.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _resolve_special_ids(directory: Path, backend, config: dict) -> dict[str, int]:
    ids = dict(backend.default_special_ids)
    for role in SPECIAL_ROLES:
        token = _token_content(config.get(f"{role}_token"))
        if token is None:
            continue
        token_id = backend.token_to_id(token)
        if token_id is None:
            raise TokenizerError(f"{directory}: {role}_token {token!r} from the config is not in the vocabulary")
        ids[role] = token_id
    return ids


def _read_chat_template(directory: Path, config: dict) -> str | None:
    # transformers v5 saves the template as its own file, which wins over the config entry.
    template_file = directory / CHAT_TEMPLATE_FILE
    if template_file.is_file():
        return template_file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}.get("default")
    return template if isinstance(template, str) else None


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load the tokenizer in local directory ``path``, preferring ``tokenizer.json`` over ``tokenizer.model``.

    Raises TokenizerError when the directory is missing, holds neither file, or a file is corrupt.
    """
    directory = Path(path)
    if not directory.is_dir():
        raise TokenizerError(f"{directory}: tokenizer directory does not exist")
    json_file, sp_file = directory / TOKENIZER_JSON, directory / SENTENCEPIECE_MODEL
    if json_file.is_file():
        backend_cls, model_file = _HFBackend, json_file
    elif sp_file.is_file():
        backend_cls, model_file = _SentencePieceBackend, sp_file
    else:
        raise TokenizerError(f"{directory}: no {TOKENIZER_JSON} or {SENTENCEPIECE_MODEL} in tokenizer directory")
    try:
        backend = backend_cls(model_file)
    # Both libraries fail from native code with untyped errors (tokenizers raises bare Exception,
    # sentencepiece RuntimeError/OSError), so anything raised while parsing means a corrupt file.
    except Exception as err:
        raise TokenizerError(f"{directory}: corrupt {model_file.name} ({_one_line(err)})") from None
    # tokenizer_config.json wins over the older special_tokens_map.json, as in transformers.
    config = _read_json(directory / SPECIAL_TOKENS_MAP) | _read_json(directory / TOKENIZER_CONFIG)
    return Tokenizer(
        backend,
        directory=directory,
        special_ids=_resolve_special_ids(directory, backend, config),
        chat_template=_read_chat_template(directory, config),
    )


def train_sentencepiece(
    texts: Iterable[str],
    out_dir: str | Path,
    vocab_size: int,
    *,
    model_type: str = "bpe",
    split_digits: bool = True,
    user_defined_symbols: Iterable[str] = (),
) -> Path:
    """Train a sentencepiece model on ``texts`` and write it to ``out_dir/tokenizer.model``; return that path.

    Ids are fixed: unk=0, bos=1 (``<s>``), eos=2 (``</s>``), pad=3 (``<pad>``), then 256 byte pieces
    (byte fallback, so any text encodes). ``vocab_size`` is an upper bound: a small corpus yields fewer
    pieces. The same texts in the same order give the same pieces and scores.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(texts),
            model_prefix=str(out_dir / Path(SENTENCEPIECE_MODEL).stem),
            vocab_size=vocab_size,
            model_type=model_type,
            byte_fallback=True,
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=3,
            pad_piece="<pad>",
            hard_vocab_limit=False,
            # Digit by digit keeps arithmetic learnable and stops numbers from filling the vocab.
            split_digits=split_digits,
            user_defined_symbols=list(user_defined_symbols),
            # Identity normalisation keeps decode(encode(text)) == text, whitespace included.
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            character_coverage=1.0,
            # Determinism: one thread, every sentence used, in the order given.
            num_threads=1,
            input_sentence_size=0,
            shuffle_input_sentence=False,
            minloglevel=2,
        )
    except RuntimeError as err:
        raise TokenizerError(f"{out_dir}: sentencepiece training failed ({_one_line(err)})") from None
    return out_dir / SENTENCEPIECE_MODEL
