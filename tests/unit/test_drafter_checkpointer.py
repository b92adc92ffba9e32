import json
import logging
import time

import pytest
import torch

from megatron_tlt.drafter import checkpoint_paths, checkpointer, store
from megatron_tlt.drafter.model import EagleDrafter
from megatron_tlt.formats.architecture import architecture_from_dict
from megatron_tlt.formats.hf_io import CheckpointError
from tiny_models import TINY_LLAMA, TINY_QWEN2
from megatron_tlt.spec.eagle import DrafterMismatch, expected_drafter_shapes

LLAMA = architecture_from_dict(TINY_LLAMA)


def _trained_drafter(seed: int = 0):
    """A drafter and its Adam after a few steps, so both carry non-trivial state."""
    drafter = EagleDrafter(LLAMA, seed=seed)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-3)
    for _ in range(2):
        optimizer.zero_grad()
        sum((p.float() ** 2).sum() for p in drafter.parameters()).backward()
        optimizer.step()
    return drafter, optimizer


def _save(run_dir, step, drafter, optimizer, *, rank=0, world=1, keep=2):
    ckpt = checkpointer.AsyncDrafterCheckpointer(run_dir, LLAMA, rank=rank, world=world, keep=keep)
    ckpt.save(step, drafter, optimizer, info={"tokens_trained": 123})
    ckpt.close()
    return ckpt


def test_saved_drafter_is_a_servable_eagle_dir_and_round_trips_exactly(tmp_path):
    drafter, optimizer = _trained_drafter()
    _save(tmp_path, 4, drafter, optimizer)
    [(step, directory)] = checkpoint_paths.list_drafter_checkpoints(tmp_path)
    assert step == 4 and directory.name == "step_000004"
    config = json.loads((directory / store.CONFIG_FILE).read_text())
    assert config["num_hidden_layers"] == 1 and config["architectures"] == ["LlamaForCausalLM"]
    tensors = store.read_drafter_tensors(directory, LLAMA)
    assert set(tensors) == set(expected_drafter_shapes(LLAMA))  # no model. prefix, no embedding, no LM head
    assert store.read_drafter_info(directory) == {"step": 4, "tokens_trained": 123}

    restored, fresh_adam = _trained_drafter(seed=1)
    restored.load_tensors(tensors)
    assert checkpointer.load_adam_state(tmp_path, 4, fresh_adam, rank=0, world=1)
    for a, b in zip(drafter.state_dict().values(), restored.state_dict().values()):
        assert torch.equal(a, b)
    want, got = optimizer.state_dict()["state"], fresh_adam.state_dict()["state"]
    assert all(torch.equal(want[k]["exp_avg_sq"], got[k]["exp_avg_sq"]) for k in want)


def test_save_hands_off_without_copying_and_says_while_it_is_writing(tmp_path):
    drafter, optimizer = _trained_drafter()
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    ckpt = checkpointer.AsyncDrafterCheckpointer(tmp_path, LLAMA, rank=0, world=1, keep=2)
    ckpt.save(1, drafter, optimizer, info={})
    while ckpt.writing():  # the spot trainer does not train meanwhile
        time.sleep(0.001)
    with torch.no_grad():  # training may go on once the write is done
        for p in drafter.parameters():
            p.add_(1.0)
    ckpt.close()
    saved = store.read_drafter_tensors(tmp_path / "drafter" / "step_000001", LLAMA)
    assert all(torch.equal(saved[k], before[k]) for k in before)


def test_partial_writes_are_ignored_and_the_resume_point_is_the_newest_not_after_the_step(tmp_path):
    drafter, optimizer = _trained_drafter()
    for step in (2, 4):
        _save(tmp_path, step, drafter, optimizer, keep=3)
    (tmp_path / "drafter" / ".step_000006.partial").mkdir()  # a run killed mid-write
    assert [s for s, _ in checkpoint_paths.list_drafter_checkpoints(tmp_path)] == [2, 4]
    assert checkpoint_paths.drafter_checkpoint_for(tmp_path, 5)[0] == 4
    assert checkpoint_paths.drafter_checkpoint_for(tmp_path, 3)[0] == 2
    assert checkpoint_paths.drafter_checkpoint_for(tmp_path, 1) is None
    # no Adam file for this rank layout: the caller starts a fresh Adam
    assert not checkpointer.load_adam_state(tmp_path, 4, optimizer, rank=1, world=2)


def test_only_the_newest_checkpoints_are_kept_per_rank(tmp_path):
    drafter, optimizer = _trained_drafter()
    for step in (1, 2, 3):
        for rank in (0, 1):
            _save(tmp_path, step, drafter, optimizer, rank=rank, world=2, keep=2)
    assert [s for s, _ in checkpoint_paths.list_drafter_checkpoints(tmp_path)] == [2, 3]
    adam = sorted(p.name for p in (tmp_path / "drafter" / "adam").iterdir())
    assert adam == ["step_000002_rank0of2.pt", "step_000002_rank1of2.pt",
                    "step_000003_rank0of2.pt", "step_000003_rank1of2.pt"]


def test_a_failed_write_is_logged_and_keeps_the_previous_checkpoint(tmp_path, caplog):
    drafter, optimizer = _trained_drafter()
    _save(tmp_path, 2, drafter, optimizer)
    (tmp_path / "drafter" / "adam" / "step_000004_rank0of1.pt").mkdir()  # the rename onto it will fail
    with caplog.at_level(logging.ERROR):
        _save(tmp_path, 4, drafter, optimizer)
    assert "drafter checkpoint of step 4 was not written" in caplog.text
    assert [s for s, _ in checkpoint_paths.list_drafter_checkpoints(tmp_path)] == [2]


def test_reading_refuses_a_missing_or_mismatched_drafter(tmp_path):
    with pytest.raises(CheckpointError, match="not a drafter directory"):
        store.read_drafter_tensors(tmp_path, LLAMA)
    qwen = architecture_from_dict(TINY_QWEN2)
    directory = tmp_path / "qwen-drafter"
    directory.mkdir()
    store.write_drafter_files(directory, qwen, EagleDrafter(qwen).export_tensors(), info={})
    with pytest.raises(DrafterMismatch, match="qwen-drafter"):
        store.read_drafter_tensors(directory, LLAMA)
