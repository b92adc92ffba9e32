"""Local tokenizer loading: sentencepiece and HF tokenizer.json backends, chat rendering, error cases."""

import json
import random

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from megatron_tlt.formats.tokenizer import TokenizerError, load_tokenizer, train_sentencepiece

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def arithmetic_sentences(num_sentences: int = 200, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    sentences = []
    for _ in range(num_sentences):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice("+-*")
        result = {"+": a + b, "-": a - b, "*": a * b}[op]
        sentences.append(f"What is {a} {op} {b}? The answer is {result}.")
    return sentences


@pytest.fixture
def sp_dir(tmp_path):
    out_dir = tmp_path / "sp"
    train_sentencepiece(arithmetic_sentences(), out_dir, vocab_size=320)
    return out_dir


@pytest.fixture
def hf_dir(tmp_path):
    tok = HFTokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(arithmetic_sentences(), trainer)
    out_dir = tmp_path / "hf"
    out_dir.mkdir()
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "bos_token": "<s>",
        "eos_token": {"content": "</s>", "__type": "AddedToken"},  # the serialised AddedToken form
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config))
    return out_dir


def test_sentencepiece_round_trips_text(sp_dir):
    tok = load_tokenizer(sp_dir)
    for text in ["What is 12 + 7? The answer is 19.", "  spaces  and\nnewlines ", "unseen: héllo ☃ 中文"]:
        assert tok.decode(tok.encode(text)) == text


def test_sentencepiece_special_token_ids_are_fixed(sp_dir):
    tok = load_tokenizer(sp_dir)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 3)
    assert tok.encode("1 + 1", add_bos=True)[0] == 1
    assert tok.encode("1 + 1")[0] != 1
    assert tok.decode([1, *tok.encode("7"), 2]) == "<s>7</s>"
    assert tok.decode([1, *tok.encode("7"), 2], skip_special_tokens=True) == "7"


def test_sentencepiece_vocab_is_bounded_and_covers_bytes(sp_dir):
    tok = load_tokenizer(sp_dir)
    assert 4 + 256 < tok.vocab_size <= 320
    assert all(0 <= i < tok.vocab_size for i in tok.encode("any text ✓ 42"))


def test_sentencepiece_splits_digits(sp_dir):
    tok = load_tokenizer(sp_dir)
    assert len(tok.encode("1234567")) >= 7


def test_sentencepiece_training_is_deterministic(tmp_path):
    first = train_sentencepiece(arithmetic_sentences(), tmp_path / "a", vocab_size=320)
    second = train_sentencepiece(arithmetic_sentences(), tmp_path / "b", vocab_size=320)
    assert first == tmp_path / "a" / "tokenizer.model"
    # The .model file records its own output path, so compare the pieces and scores instead.
    assert (first.parent / "tokenizer.vocab").read_bytes() == (second.parent / "tokenizer.vocab").read_bytes()


def test_sentencepiece_training_on_no_text_raises_tokenizer_error(tmp_path):
    with pytest.raises(TokenizerError, match="training failed"):
        train_sentencepiece([], tmp_path / "empty", vocab_size=320)


def test_sentencepiece_chat_renders_and_encodes_eos_as_one_token(sp_dir):
    (sp_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    tok = load_tokenizer(sp_dir)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}])
    assert prompt == "<|user|>What is 2 + 2?</s><|assistant|>"
    assert tok.encode(prompt).count(tok.eos_id) == 1


def test_sentencepiece_without_template_refuses_chat(sp_dir):
    tok = load_tokenizer(sp_dir)
    with pytest.raises(TokenizerError, match="no chat template") as info:
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert str(sp_dir) in str(info.value)


def test_hf_tokenizer_loads_special_tokens_from_config(hf_dir):
    tok = load_tokenizer(hf_dir)
    assert (tok.bos_id, tok.eos_id) == (1, 2)
    assert tok.pad_id == tok.eos_id  # no pad token: falls back to eos
    assert tok.vocab_size <= 320


def test_hf_tokenizer_round_trips_text(hf_dir):
    tok = load_tokenizer(hf_dir)
    text = "What is 12 + 7? The answer is 19. héllo"
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode(text, add_bos=True) == [tok.bos_id, *tok.encode(text)]


def test_hf_tokenizer_renders_chat_and_encodes_special_tokens(hf_dir):
    tok = load_tokenizer(hf_dir)
    messages = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"}]
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == (
        "<|user|>What is 2 + 2?</s><|assistant|>4</s>"
    )
    prompt = tok.apply_chat_template(messages[:1])
    assert prompt.endswith("<|assistant|>")
    ids = tok.encode(prompt)
    assert ids[0] == 3 and ids[-1] == 4 and tok.eos_id in ids
    assert tok.decode(ids) == prompt
    assert tok.decode(ids, skip_special_tokens=True) == "What is 2 + 2?"


def test_chat_template_file_wins_over_config(hf_dir):
    (hf_dir / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert load_tokenizer(hf_dir).apply_chat_template([{"role": "user", "content": "hi"}]) == "hi!"


def test_tokenizer_json_is_preferred_over_sentencepiece(hf_dir, sp_dir):
    (hf_dir / "tokenizer.model").write_bytes((sp_dir / "tokenizer.model").read_bytes())
    assert len(load_tokenizer(hf_dir).encode("<|user|>")) == 1  # an added token only the HF tokenizer has
    (hf_dir / "tokenizer.json").unlink()
    assert load_tokenizer(hf_dir).encode("<|user|>") == load_tokenizer(sp_dir).encode("<|user|>")


def test_missing_directory_raises_tokenizer_error_naming_it(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(TokenizerError, match="does not exist") as info:
        load_tokenizer(missing)
    assert str(missing) in str(info.value)


def test_empty_directory_raises_tokenizer_error_naming_it(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer.json or tokenizer.model") as info:
        load_tokenizer(tmp_path)
    assert str(tmp_path) in str(info.value)


def test_corrupt_tokenizer_json_raises_tokenizer_error(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="corrupt tokenizer.json") as info:
        load_tokenizer(tmp_path)
    assert str(tmp_path) in str(info.value) and "\n" not in str(info.value)


def test_corrupt_tokenizer_model_raises_tokenizer_error(tmp_path):
    (tmp_path / "tokenizer.model").write_bytes(b"\x00garbage")
    with pytest.raises(TokenizerError, match="corrupt tokenizer.model") as info:
        load_tokenizer(tmp_path)
    assert str(tmp_path) in str(info.value) and "\n" not in str(info.value)


def test_corrupt_tokenizer_config_raises_tokenizer_error(hf_dir):
    (hf_dir / "tokenizer_config.json").write_text("{")
    with pytest.raises(TokenizerError, match="corrupt tokenizer_config.json"):
        load_tokenizer(hf_dir)


def test_config_token_missing_from_vocab_raises_tokenizer_error(hf_dir):
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|nope|>"}))
    with pytest.raises(TokenizerError, match="eos_token '<\\|nope\\|>'"):
        load_tokenizer(hf_dir)
