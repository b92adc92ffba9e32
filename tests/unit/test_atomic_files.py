import pytest

from megatron_tlt import atomic_files


class Boom(RuntimeError):
    pass


def _names(directory):
    return sorted(p.name for p in directory.iterdir())


def test_a_text_write_replaces_the_file_and_leaves_no_staging_name(tmp_path):
    path = tmp_path / "summary.json"
    atomic_files.write_text_atomic(path, "old")
    atomic_files.write_text_atomic(path, "new")
    atomic_files.write_bytes_atomic(tmp_path / "blob", b"\x00\x01")
    assert path.read_text() == "new" and (tmp_path / "blob").read_bytes() == b"\x00\x01"
    assert _names(tmp_path) == ["blob", "summary.json"]


def test_a_failed_file_write_keeps_the_old_content_and_leaves_no_partial_file(tmp_path):
    path = tmp_path / "state.pt"
    path.write_text("old")
    with pytest.raises(Boom):
        with atomic_files.atomic_file(path) as tmp:
            tmp.write_text("half of the new")
            raise Boom
    assert path.read_text() == "old" and _names(tmp_path) == ["state.pt"]


def test_a_file_write_that_cannot_be_renamed_into_place_leaves_no_partial_file(tmp_path):
    (tmp_path / "taken").mkdir()  # a directory where the file should go
    with pytest.raises(IsADirectoryError):
        atomic_files.write_text_atomic(tmp_path / "taken", "text")
    assert _names(tmp_path) == ["taken"]


def test_a_directory_appears_complete_or_not_at_all(tmp_path):
    final = tmp_path / "out"
    with atomic_files.atomic_dir(final) as staging:
        assert staging.parent == tmp_path and staging.name.startswith(".out.partial-")
        (staging / "a").write_text("1")
        assert not final.exists()  # not under its final name while being written
    assert _names(final) == ["a"] and _names(tmp_path) == ["out"]


def test_a_failed_directory_write_leaves_no_staging_and_the_old_directory_intact(tmp_path):
    final = tmp_path / "step_000004"
    final.mkdir()
    (final / "weights").write_text("old")
    for if_exists in ("replace", "keep"):
        with pytest.raises(Boom):
            with atomic_files.atomic_dir(final, if_exists=if_exists, unique=False) as staging:
                (staging / "weights").write_text("half of the new")
                raise Boom
        assert _names(tmp_path) == ["step_000004"] and (final / "weights").read_text() == "old"


def test_refuse_does_not_start_on_a_non_empty_target_and_replaces_an_empty_one(tmp_path):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "precious").write_text("keep me")
    with pytest.raises(FileExistsError):
        with atomic_files.atomic_dir(taken):
            pytest.fail("the block must not run")
    assert _names(taken) == ["precious"] and _names(tmp_path) == ["taken"]

    empty = tmp_path / "empty"
    empty.mkdir()
    with atomic_files.atomic_dir(empty) as staging:
        (staging / "new").write_text("x")
    assert _names(empty) == ["new"]


def test_replace_and_keep_decide_who_wins_an_existing_directory(tmp_path):
    final = tmp_path / "entry"
    final.mkdir()
    (final / "theirs").write_text("first")
    with atomic_files.atomic_dir(final, if_exists="keep") as staging:  # a cache entry made meanwhile
        (staging / "ours").write_text("second")
    assert _names(final) == ["theirs"] and _names(tmp_path) == ["entry"]
    with atomic_files.atomic_dir(final, if_exists="replace") as staging:  # a resumed run saving a step again
        (staging / "ours").write_text("second")
    assert _names(final) == ["ours"] and _names(tmp_path) == ["entry"]


def test_an_owned_staging_name_is_fixed_and_a_killed_writers_leftover_is_cleared(tmp_path):
    final = tmp_path / "step_000006"
    leftover = atomic_files.staging_path(final)
    assert leftover.name == ".step_000006.partial"
    leftover.mkdir()
    (leftover / "half").write_text("x")
    with atomic_files.atomic_dir(final, if_exists="replace", unique=False) as staging:
        assert staging == leftover and not (staging / "half").exists()
        (staging / "whole").write_text("y")
    assert _names(tmp_path) == ["step_000006"] and _names(final) == ["whole"]
    assert atomic_files.staging_path(final, unique=True) != atomic_files.staging_path(final, unique=True)


def test_prune_keeps_the_newest_n_by_step_not_by_name(tmp_path):
    for step in (9, 10, 100, 2):  # by name, step_9 sorts after step_100
        (tmp_path / f"step_{step}").mkdir()
        (tmp_path / f"step_{step}" / "f").write_text("x")
        (tmp_path / f"step_{step:06d}_rank0of2.pt").write_text("x")
    dirs = [p for p in tmp_path.iterdir() if p.is_dir()]
    removed = atomic_files.prune_oldest(dirs, 2)
    assert [p.name for p in removed] == ["step_2", "step_9"]
    atomic_files.prune_oldest(tmp_path.glob("step_*_rank0of2.pt"), 3)
    assert _names(tmp_path) == ["step_000009_rank0of2.pt", "step_000010_rank0of2.pt", "step_000100_rank0of2.pt",
                                "step_10", "step_100"]


def test_prune_keeps_everything_when_keep_is_not_positive_and_refuses_unnamed_paths(tmp_path):
    paths = [tmp_path / f"step_{s}" for s in (1, 2)]
    for p in paths:
        p.mkdir()
    assert atomic_files.prune_oldest(paths, 0) == [] and all(p.is_dir() for p in paths)
    assert atomic_files.prune_oldest(paths, 5) == []
    with pytest.raises(ValueError, match="not named step_N"):
        atomic_files.prune_oldest([tmp_path / "latest"], 1)
    assert [p.name for p in atomic_files.prune_oldest(paths, 1, key=lambda p: -atomic_files.step_of(p))] == ["step_2"]
