"""The docs live in the repo and say what the code does (docs/architecture.md lists them):

- the generated documents (docs/configuration.md, docs/cli.md) are what the config model and the
  CLI's parsers make now (`make docs` writes them);
- the README is a front page of at most 200 lines that links every document of docs/;
- no document, and no file of the repo, sends a reader outside it;
- every link and repo path a document names exists, every `aivedio.x.y` it names imports, every
  `aivedio ...` command it shows is one the CLI has;
- the architecture's rooms table names every room of the house's LAYERS."""
from __future__ import annotations

import argparse
import importlib
import re
import subprocess
from pathlib import Path

import pytest

from aivedio_tools import docs
from aivedio_tools.cli import build_parser
from tests.unit import test_house

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
REQUIRED = ("architecture.md", "operations.md", "configuration.md", "cli.md", "tenant-api.md", "admin-api.md",
            "provider-protocol.md", "testing.md")
PAGES = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "infra_cdk" / "README.md",
         ROOT / "containers" / "gpu-render" / "README.md"]
THIS = str(Path(__file__).resolve().relative_to(ROOT))  # states the rule, so it names what it forbids
OUTSIDE = re.compile(r"\.\./shared|(?<![\w/.-])contracts/|/work/")


def _page_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_the_generated_documents_are_fresh():
    assert docs.stale() == [], "run `make docs`"


def test_a_stale_document_is_caught(tmp_path, monkeypatch):
    monkeypatch.setattr(docs, "DOCS", tmp_path)
    assert docs.stale() == list(docs.DOCUMENTS)  # missing
    for name, make in docs.DOCUMENTS.items():
        (tmp_path / name).write_text(make())
    assert docs.stale() == []
    (tmp_path / "cli.md").write_text(docs.cli_reference().replace("--operator", "--operater", 1))
    assert docs.stale() == ["cli.md"]


def test_the_readme_is_a_front_page_that_links_every_document():
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    for name in REQUIRED:
        assert (ROOT / "docs" / name).is_file(), f"docs/{name} is missing"
        assert f"](docs/{name})" in text, f"the README does not link docs/{name}"


def test_nothing_in_the_repo_sends_a_reader_outside_it():
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    hits = []
    for name in tracked.decode().split("\0"):
        path = ROOT / name
        if not name or name == THIS or not path.is_file() or path.suffix in {".png", ".gz", ".mp4", ".pyc"}:
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        hits += [f"{name}:{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1) if OUTSIDE.search(line)]
    assert hits == []


def test_a_reference_outside_the_repo_is_caught():
    assert OUTSIDE.search("see contracts/operations.md") and OUTSIDE.search("../shared/seeds/ch18.md")
    assert not OUTSIDE.search("see docs/operations.md") and not OUTSIDE.search("infra_cdk/contracts.py")


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_link_and_path_a_page_names_exists(page):
    text = page.read_text()
    missing = []
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" not in target and not (page.parent / target).exists():
            missing.append(target)
    # Repo paths in backticks: a top-level folder of the repo, then a path (placeholders, and what a
    # build writes to an ignored folder, aside).
    tops = "|".join(p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith("."))
    for path in re.findall(rf"`((?:{tops})/[\w./-]*[\w/])`", text):
        if not any(ch in path for ch in "<>*") and not (ROOT / path).exists() and not _ignored(path):
            missing.append(path)
    assert missing == []


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_module_a_page_names_imports(page):
    missing = []
    for name in sorted(set(re.findall(r"\b(aivedio(?:_tools)?(?:\.[a-z_][A-Za-z0-9_]*)+)\b", page.read_text()))):
        if name.endswith((".example", ".toml", ".md", ".py")) or ".example." in name:
            continue
        if _resolve(name) is None:
            missing.append(name)
    assert missing == []


def _ignored(path: str) -> bool:
    return subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT).returncode == 0


def _resolve(dotted: str):
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return None
            obj = getattr(obj, attr)
        return obj
    return None


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _unknown_commands(text: str) -> list[str]:
    """Each `aivedio ...` command shown in `text` whose sub-commands the CLI does not have."""
    unknown = []
    for shown in re.findall(r"(?:`|\.venv/bin/)aivedio ([a-z][^`\n]*)", text):
        parsers = [build_parser()]
        for word in shown.split():
            if not re.fullmatch(r"[a-z][a-z-]*(\|[a-z][a-z-]*)*", word):
                break  # a flag, a placeholder, "..."
            below = [_subcommands(p) for p in parsers]
            if not all(below):
                break  # a positional argument of a command
            if not all(alt in b for b in below for alt in word.split("|")):
                unknown.append(f"aivedio {shown}")
                break
            parsers = [b[alt] for b in below for alt in word.split("|")]
    return unknown


@pytest.mark.parametrize("page", [p for p in PAGES if p.name != "cli.md"], ids=_page_id)
def test_every_command_a_page_shows_is_one_the_cli_has(page):
    assert _unknown_commands(page.read_text()) == []


def test_an_unknown_command_is_caught():
    assert _unknown_commands("`aivedio admin operator grant --role X`") == ["aivedio admin operator grant --role X"]
    assert _unknown_commands("`aivedio admin refund create|approve|reject|list`") == []
    assert _unknown_commands("`aivedio admin refund create|appove`") == ["aivedio admin refund create|appove"]


def test_the_architecture_names_every_room():
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text[text.index("## The rooms"):]
    table = table[:table.index("\n#", 4)]
    for layer, rooms in test_house.LAYERS:
        row = next((line for line in table.splitlines() if line.startswith(f"| {layer} |")), None)
        assert row is not None, f"the rooms table has no row for the layer {layer!r}"
        cell = row.split(" | ")[1]
        named = {m.rstrip("/") for m in re.findall(r"`([\w./]+)`", cell)}
        assert named == set(rooms), f"{layer}: the table names {sorted(named)}, LAYERS {sorted(rooms)}"
