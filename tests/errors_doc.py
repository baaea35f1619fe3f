"""docs/errors.md as the tests read it: every row with a case id, and one check that what marsi printed is that row.

A row is `| `case_id` | ... | exit | message |` in any table of docs/errors.md (the message is the last cell, the
exit status the one before). In a message, the words the test names (`RUN`, `NODE`, `AGENT`, `<tmp>`, ...) stand for
the test's own values, and `…` for machine-specific text (a library's reason, a pid, a byte count). A row that says
"checked in part" in one of its cells is exempt from the rule that some test checks it whole.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

from protocols.errors import UserError, one_line

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "errors.md"
TESTS = REPO / "tests"
_ROW = re.compile(r"^\| `([a-z0-9_]+)` \|(.*)\|$", re.M)


@functools.cache
def rows() -> dict[str, tuple[str, str, str]]:
    """case id -> (exit status, message, the whole row) for every row of docs/errors.md that has one."""
    found: dict[str, tuple[str, str, str]] = {}
    for case, rest in _ROW.findall(DOC.read_text()):
        cells = [cell.strip() for cell in rest.split(" | ")]
        assert case not in found, f"docs/errors.md: case {case} has two rows"
        found[case] = (cells[-2], cells[-1], rest)
    return found


def _word(name: str) -> str:
    """`name` where it stands alone: RUN but not RUN_NAME."""
    edge = lambda c: r"\b" if c.isalnum() or c == "_" else ""  # noqa: E731
    return edge(name[0]) + re.escape(name) + edge(name[-1])


def pattern(documented: str, values: dict[str, object]) -> str:
    """The regular expression a documented message stands for, given the test's values of its placeholders."""
    names = {f"<{k}>" if k in ("tmp", "repo") else k: str(v) for k, v in values.items()}
    names.setdefault("<repo>", str(REPO))
    words = sorted(names, key=len, reverse=True)
    token = re.compile("|".join(["…"] + [_word(w) for w in words]))
    parts, pos = [], 0
    for m in token.finditer(documented):
        parts += [re.escape(documented[pos:m.start()]), ".+?" if m.group() == "…" else re.escape(names[m.group()])]
        pos = m.end()
    return "".join(parts + [re.escape(documented[pos:])])


def assert_documented(case: str, printed: str | BaseException, *, exit: int | None = None, **values: object) -> None:
    """What marsi printed is the row `case` of docs/errors.md, whole, with its exit status.

    `printed` is the line marsi printed (`marsi: error: ...`, `exit` its status), or the exception a test caught
    below the CLI, which the CLI would print as `marsi: error: ` and its one-line text, exiting with 2 for a
    UserError (orchestrator/cli.py).
    """
    assert case in rows(), f"docs/errors.md has no row for case {case}"
    status, documented, _ = rows()[case]
    if isinstance(printed, BaseException):
        exit = 2 if isinstance(printed, (UserError, FileNotFoundError)) else 1
        printed = f"marsi: error: {one_line(printed)}"
    message = printed.strip()
    assert re.fullmatch(pattern(documented, values), message, flags=re.S), (
        f"docs/errors.md, case {case}:\n  documented: {documented}\n  printed:    {message}")
    if exit is not None:
        assert status == str(exit), f"docs/errors.md, case {case}: exit {status}, marsi exited {exit}"


def assert_quoted(message: str, **values: object) -> None:
    """`message` is quoted whole (between backticks) in docs/errors.md: for messages of the 'handled' paragraphs."""
    quotes = re.findall(r"`([^`]+)`", DOC.read_text().replace("\n", " "))
    message = message.strip()
    assert any(re.fullmatch(pattern(q, values), message, flags=re.S) for q in quotes), (
        f"docs/errors.md quotes no message that is: {message}")
