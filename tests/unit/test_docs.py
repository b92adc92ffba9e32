"""The Markdown docs: the generated config reference is current, and every relative link resolves."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

from script_modules import REPO, load_script

make_config_page = load_script("docs/make_config_page.py", "make_config_page")  # docs/ is not a package

MARKDOWN_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_CODE_SPAN = re.compile(r"(`+).*?\1")
# [text](target) and ![alt](target); the target may be <bracketed> and be followed by a "title"
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*(<[^>]*>|[^)\s]*)[^)]*\)")
_HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...: not a file of this repo


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks (a fence closes on the same character, at least as long)."""
    lines, fence = [], None
    for line in text.splitlines():
        match = _FENCE.match(line)
        if fence is None and match:
            fence = match.group(1)
        elif fence is not None:
            if match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence):
                fence = None
        else:
            lines.append(line)
    return lines


def relative_links(text: str) -> list[str]:
    """Targets of Markdown links and images that point into the repository, in order."""
    targets = []
    for line in _prose_lines(text):
        for match in _LINK.finditer(_CODE_SPAN.sub("", line)):  # `[a](b)` in inline code is not a link
            target = match.group(1).strip("<>")
            if target and not _SCHEME.match(target):
                targets.append(target)
    return targets


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation but '-' and '_' dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a Markdown file's headings; GitHub numbers repeats: slug, slug-1, slug-2."""
    found: set[str] = set()
    for line in _prose_lines(text):
        match = _HEADING.match(line)
        if match:
            slug = base = github_slug(match.group(1))
            repeat = 0
            while slug in found:
                repeat += 1
                slug = f"{base}-{repeat}"
            found.add(slug)
    return found


def broken_links(markdown_file: Path) -> list[str]:
    """Each relative link of the file that does not resolve, with the reason."""
    broken = []
    for target in relative_links(markdown_file.read_text(encoding="utf-8")):
        path_part, _, anchor = target.partition("#")
        path = (markdown_file.parent / unquote(path_part)).resolve() if path_part else markdown_file
        if not path.exists():
            broken.append(f"{target}: {path.relative_to(REPO) if path.is_relative_to(REPO) else path} does not exist")
        elif anchor and path.suffix == ".md" and unquote(anchor) not in anchors(path.read_text(encoding="utf-8")):
            broken.append(f"{target}: no heading with the anchor #{anchor} in {path.name}")
    return broken


def test_configuration_page_matches_the_config_docstrings():
    page = make_config_page.PAGE
    assert page.is_file(), f"{page} is missing: run `{make_config_page.COMMAND}`"
    assert page.read_text(encoding="utf-8") == make_config_page.render(), (
        f"docs/configuration.md is stale (megatron_tlt/config.py changed): run `{make_config_page.COMMAND}`")


def test_check_mode_fails_on_a_stale_page_and_names_the_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(make_config_page, "PAGE", tmp_path / "configuration.md")
    (tmp_path / "configuration.md").write_text("old\n", encoding="utf-8")
    assert make_config_page.main(["--check"]) == 1
    assert "python docs/make_config_page.py" in capsys.readouterr().err
    assert make_config_page.main([]) == 0 and make_config_page.main(["--check"]) == 0


def test_configuration_page_lists_every_config_key_once():
    from megatron_tlt.config import valid_keys

    page = make_config_page.render()
    for key in valid_keys():
        assert page.count(f"- **`{key}`**") == 1, key


@pytest.mark.parametrize("markdown_file", MARKDOWN_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_in_the_docs_resolves(markdown_file):
    assert broken_links(markdown_file) == []


def test_link_helper_reads_links_and_images_but_not_code_or_urls():
    text = """\
See [the guide](docs/guide.md#set-up) and ![a figure](bench/fig.png "title").
[web](https://example.com), [mail](mailto:a@b.c), [here](#local), `[code](not/a/link.md)`
```bash
echo [x](inside/a/fence.md)
```
[after](after.md)
"""
    assert relative_links(text) == ["docs/guide.md#set-up", "bench/fig.png", "#local", "after.md"]


def test_link_helper_reports_a_missing_file_and_a_missing_anchor(tmp_path, monkeypatch):
    monkeypatch.setitem(globals(), "REPO", tmp_path)  # messages name paths from the repository root
    (tmp_path / "guide.md").write_text("# Set-up: the `tlt train` command!\n## Set-up: the `tlt train` command!\n")
    (tmp_path / "figure.png").write_bytes(b"")
    readme = tmp_path / "README.md"
    readme.write_text("[ok](guide.md#set-up-the-tlt-train-command) [repeat](guide.md#set-up-the-tlt-train-command-1) "
                      "![ok](figure.png) [gone](missing.md) [bad anchor](guide.md#nowhere) [self](#nowhere)\n")
    assert broken_links(readme) == [
        "missing.md: missing.md does not exist",
        "guide.md#nowhere: no heading with the anchor #nowhere in guide.md",
        "#nowhere: no heading with the anchor #nowhere in README.md",
    ]
