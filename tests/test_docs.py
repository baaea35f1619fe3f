"""The documentation runs: every fenced block of the README and docs/ is run here, or marked as not run with a reason.

A block preceded by `<!-- not run: REASON -->` is skipped (the reason is required). Every other block runs:
- `bash`: each command (continuation lines joined; comments dropped) in a scratch directory that sees the
  repository's examples/, with `marsi` and `python` from this interpreter's environment; it must exit 0;
- `python`: the whole block in a fresh interpreter, from that directory;
- `yaml`: parsed, and each top-level section validated against its part of the run config's schema.
A block of any other language must be marked. The site itself is built with `mkdocs build --strict`.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from pydantic import TypeAdapter

from protocols.config import RunConfig


REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", REPO / "benchmarks" / "RESULTS.md", *sorted((REPO / "docs").rglob("*.md"))]
BLOCK = re.compile(r"(?:<!--\s*not run:(?P<reason>[^>]*)-->\s*\n)?^(?P<indent>[ \t]*)```(?P<lang>[\w-]*)[^\n]*\n"
                   r"(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)
RUNNABLE = {"bash", "python", "yaml"}


def blocks():
    for page in PAGES:
        text = page.read_text()
        for match in BLOCK.finditer(text):
            line = text.count("\n", 0, match.start("lang")) + 1
            body = "\n".join(row[len(match["indent"]):] for row in match["body"].splitlines())
            yield pytest.param(match["lang"], body, match["reason"], id=f"{page.relative_to(REPO)}:{line}")


ALL = list(blocks())


def test_the_pages_have_blocks():
    assert len(ALL) > 20 and all(page.exists() for page in PAGES)


@pytest.mark.parametrize("lang, body, reason", ALL)
def test_every_block_is_run_or_says_why_not(lang, body, reason):
    if reason is not None:
        assert reason.strip(), "a `not run:` mark needs a reason"
        return
    assert lang in RUNNABLE, f"a ```{lang} block runs nowhere: mark it <!-- not run: REASON --> or make it runnable"


def commands(body: str) -> list[str]:
    joined = re.sub(r"\\\n\s*", " ", body)
    out = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        if words:
            out.append(shlex.join(words) if ">" not in words else line.split(" #")[0])
    return out


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A directory like the repository's root for documented commands: examples/ and benchmarks/ visible."""
    root = tmp_path_factory.mktemp("docs")
    for name in ("examples", "benchmarks", "tests"):
        (root / name).symlink_to(REPO / name)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return root, env


def _runnable(lang):
    return [p for p in ALL if p.values[0] == lang and p.values[2] is None]


@pytest.mark.subprocess
@pytest.mark.parametrize("lang, body, reason", _runnable("bash"))
def test_bash_blocks_run(lang, body, reason, scratch):
    root, env = scratch
    for command in commands(body):
        done = subprocess.run(["bash", "-c", command], cwd=root, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"


@pytest.mark.subprocess
@pytest.mark.parametrize("lang, body, reason", _runnable("python"))
def test_python_blocks_run(lang, body, reason, scratch):
    root, env = scratch
    done = subprocess.run([sys.executable, "-c", body], cwd=root, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("lang, body, reason", _runnable("yaml"))
def test_yaml_blocks_follow_the_config_schema(lang, body, reason):
    raw = yaml.safe_load(body)
    assert isinstance(raw, dict)
    for section, value in raw.items():
        assert section in RunConfig.model_fields, f"{section}: not a section of the run config"
        TypeAdapter(RunConfig.model_fields[section].annotation).validate_python(value)


def test_per_role_rewards_are_not_said_to_be_for_zero_sum_games_only():
    for page in PAGES:
        text = " ".join(page.read_text().split())
        assert not re.search(r"per[- ]role rewards? (for|in) zero-sum games", text), page


def test_the_cli_reference_prints_help_as_marsi_help_does():
    import runpy

    page = runpy.run_path(str(REPO / "docs" / "gen_ref.py"), run_name="gen_ref")["cli_reference"]()  # not a build
    [row] = [line for line in page.splitlines() if line.startswith("| `--compare` |")]
    assert "with a 95% confidence interval" in row and "%%" not in page


def _anchors(page: Path) -> set[str]:
    """The anchors of a page's headings, as mkdocs' toc makes them (lower case, punctuation dropped, each run of
    spaces and '-' one '-')."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), re.M)
    return {re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", h.strip().lower())) for h in headings}


def test_the_readme_is_a_map():
    """At most 200 lines, opening with the two commands a newcomer runs; every page and heading it links to exists
    (the detail lives there)."""
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    assert commands(next(BLOCK.finditer(text))["body"]) == ["make demo", "make test"]
    for target, anchor in re.findall(r"\]\(([^)#:]+)(?:#([^)]*))?\)", text):
        assert (REPO / target).is_file(), target
        assert not anchor or anchor in _anchors(REPO / target), f"{target}#{anchor}"


@pytest.mark.subprocess
@pytest.mark.skipif(shutil.which("mkdocs", path=str(Path(sys.executable).parent)) is None,
                    reason="needs the docs extra (make setup installs it)")
def test_the_site_builds_without_warnings(tmp_path):
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent))
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", DISABLE_MKDOCS_2_WARNING="true", HF_HUB_OFFLINE="1")
    done = subprocess.run([mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "WARNING" not in done.stderr, done.stderr
    config = (tmp_path / "site" / "reference" / "config" / "index.html").read_text()
    assert "transcripts_per_step" in config and "agents.NAME.rollout.vllm" in config
    assert "marsi export" in (tmp_path / "site" / "reference" / "cli" / "index.html").read_text()
