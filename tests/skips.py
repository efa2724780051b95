"""The skipped-tests record and check of CI (``.ci/run``): a test group that should run and
starts skipping (a broken llama.cpp install, torch without oneDNN) fails CI instead of passing
unseen.

``.ci/run`` names a file in ``$ADASPEC_SKIPS_FILE``; the suite's conftest registers
``SkipRecord``, a pytest plugin that writes there the node ids of every test or module that
skipped, with the reason, one a line, sorted (from the controlling process under pytest-xdist,
which gets every worker's reports). ``python tests/skips.py EXPECTED RECORD`` then compares
them with ``tests/expected_skips.txt``:

* ``tests/x.py::test_y  # why`` must skip;
* ``? tests/x.py::test_y  # why`` may skip or run: what depends on the machine (a model a
  command fetches into ``~/.cache``, which an earlier session may have left there);
* ``#`` starts a comment.

It exits 1 with a diff naming each unexpected skip (and its reason) and each expected skip that
ran, 0 when the sets agree.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

#: the environment variable that names the file the skipped node ids are written to
SKIPS_FILE_ENV = "ADASPEC_SKIPS_FILE"


class SkipRecord:
    """The pytest plugin: notes every skipped test (any phase) and module (a collection report;
    xfails are not skips) and, at the end of the session, writes them where
    ``$ADASPEC_SKIPS_FILE`` says, from the controlling process only (a pytest-xdist worker's
    ``config`` has ``workerinput``): ``node id  # reason`` lines. Nothing without the variable."""

    def __init__(self) -> None:
        self.skipped: dict[str, str] = {}

    def _note(self, report) -> None:
        if report.skipped and not hasattr(report, "wasxfail"):
            longrepr = report.longrepr
            reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
            self.skipped.setdefault(report.nodeid, " ".join(str(reason).split()))

    def pytest_runtest_logreport(self, report) -> None:
        self._note(report)

    def pytest_collectreport(self, report) -> None:
        self._note(report)

    def pytest_sessionfinish(self, session) -> None:
        path = os.environ.get(SKIPS_FILE_ENV)
        if path and not hasattr(session.config, "workerinput"):
            Path(path).write_text("".join(f"{node}  # {self.skipped[node]}\n" for node in sorted(self.skipped)))


def parse(lines: list[str]) -> tuple[dict[str, str], set[str]]:
    """(node id -> reason or comment, ids that may run) of an expected list or a record."""
    found, optional = {}, set()
    for raw in lines:
        text, _, note = raw.partition("#")
        text = text.strip()
        if not text:
            continue
        may = text.startswith("?")
        node = text[1:].strip() if may else text
        found[node] = note.strip()
        if may:
            optional.add(node)
    return found, optional


def compare(expected_lines: list[str], actual_lines: list[str]) -> list[str]:
    """The differences between an expected list and a record, one line each (empty: they agree)."""
    expected, optional = parse(expected_lines)
    actual, _ = parse(actual_lines)
    out = [f"+ {node}  # skipped, not expected: {actual[node]}" for node in sorted(set(actual) - set(expected))]
    out += [f"- {node}  # expected to skip ({expected[node]}), but it ran"
            for node in sorted(set(expected) - set(actual) - optional)]
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python tests/skips.py EXPECTED_LIST SKIPS_RECORD", file=sys.stderr)
        return 2
    expected, record = (Path(a) for a in argv)
    if not record.is_file():
        print(f"no record of skipped tests at {record}: the test command did not run the suite's "
              f"conftest (or did not finish)", file=sys.stderr)
        return 1
    diff = compare(expected.read_text().splitlines(), record.read_text().splitlines())
    if diff:
        print(f"the skipped tests differ from {expected} (+ skipped unexpectedly, - expected to skip "
              "but ran):", file=sys.stderr)
        print("\n".join(diff), file=sys.stderr)
        print(f"Fix what makes them skip, or, if the change is meant, update {expected}.", file=sys.stderr)
        return 1
    n = len(parse(record.read_text().splitlines())[0])
    print(f"skipped tests as expected ({n}, listed in {expected})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
