"""The tiny default's shipped starting point: copies checked against their manifest, installed into the cache
under the cache key a run computes, and the copies shipped are the current default's."""

import json

import pytest

from megatron_tlt.rl.tiny import shipped_start


def _ship(root, name, files):
    for rel, data in files.items():
        (root / name / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / name / rel).write_bytes(data)
    manifest = {"entries": {name: shipped_start.entry_files(root / name)}}
    (root / shipped_start.MANIFEST).write_text(json.dumps(manifest))


def test_a_shipped_entry_installs_byte_for_byte(tmp_path):
    root, cache = tmp_path / "shipped", tmp_path / "cache"
    files = {"model/__0_0.distcp": b"\x00\x01weights", "tlt_checkpoint.json": b"{}"}
    _ship(root, "policy-0123456789abcdef", files)
    assert shipped_start.install(cache / "policy-0123456789abcdef", root)
    assert {p.relative_to(cache / "policy-0123456789abcdef").as_posix(): p.read_bytes()
            for p in (cache / "policy-0123456789abcdef").rglob("*") if p.is_file()} == files
    assert not shipped_start.install(cache / "policy-fedcba9876543210", root)  # another key: made, not shipped
    assert not list(cache.glob(".*"))  # no staging directory left behind


def test_a_damaged_shipped_entry_is_refused_and_nothing_is_installed(tmp_path):
    root, cache = tmp_path / "shipped", tmp_path / "cache"
    _ship(root, "drafter-0123456789abcdef", {"model.safetensors": b"good", "config.json": b"{}"})
    (root / "drafter-0123456789abcdef" / "model.safetensors").write_bytes(b"edited")
    with pytest.raises(shipped_start.ShippedEntryError, match="model.safetensors missing or not the shipped bytes"):
        shipped_start.install(cache / "drafter-0123456789abcdef", root)
    (root / "drafter-0123456789abcdef" / "config.json").unlink()
    with pytest.raises(shipped_start.ShippedEntryError, match="config.json, model.safetensors"):
        shipped_start.install(cache / "drafter-0123456789abcdef", root)
    assert not (cache / "drafter-0123456789abcdef").exists()


def test_every_shipped_file_matches_the_manifest():
    manifest = shipped_start.read_manifest()
    for name, files in manifest["entries"].items():
        assert shipped_start.entry_files(shipped_start.SHIPPED_DIR / name) == files, name


def test_the_tiny_default_starts_from_the_shipped_policy_and_drafter(tmp_path):
    """The shipped copies are the current default's: a change to what their cache keys hold (shape, warm-up
    or cold-start recipe) must ship new ones (``python -m checkpoints_tools.ship_tiny_default``)."""
    from megatron_tlt.commands.start import cold_start_drafter
    from megatron_tlt.config import load_config
    from megatron_tlt.rl.tiny import tiny_default
    from megatron_tlt.rl.tiny.tiny_source import warmed_up_dir

    shipped = set(shipped_start.read_manifest()["entries"])
    config = load_config("tiny", [f"warmup.cache_dir={tmp_path}"])
    tokenizer = tiny_default.load_task_tokenizer(tmp_path)
    assert warmed_up_dir(config, tokenizer).name in shipped
    # installed from the package, not made: nothing is launched
    drafter = cold_start_drafter("tiny", [f"warmup.cache_dir={tmp_path}"], make=False)
    assert drafter.name in shipped and (drafter / "model.safetensors").is_file()
