"""CI's check of the skipped tests (``tests/skips.py``, run by ``.ci/run``): the record a pytest
run writes (with pytest-xdist too), the comparison with the expected list, its exit codes and
diff, and that every entry of ``tests/expected_skips.txt`` names a test that exists."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from skips import SKIPS_FILE_ENV, compare, main, parse

TESTS = Path(__file__).resolve().parent

EXPECTED = """# a comment
tests/a.py::test_x  # needs a thing
? tests/a.py::test_maybe[p-1]  # needs a fetched file
tests/b.py
"""


def test_compare_reports_unexpected_skips_and_expected_ones_that_ran():
    assert compare(EXPECTED.splitlines(), ["tests/a.py::test_x  # r", "tests/b.py  # r"]) == []
    assert compare(EXPECTED.splitlines(), ["tests/a.py::test_x", "tests/b.py", "tests/a.py::test_maybe[p-1]"]) == []
    diff = compare(EXPECTED.splitlines(), ["tests/a.py::test_x  # r", "tests/c.py::test_new  # llama.cpp is broken"])
    assert diff == ["+ tests/c.py::test_new  # skipped, not expected: llama.cpp is broken",
                    "- tests/b.py  # expected to skip (), but it ran"]
    nodes, optional = parse(EXPECTED.splitlines())
    assert set(nodes) == {"tests/a.py::test_x", "tests/a.py::test_maybe[p-1]", "tests/b.py"}
    assert optional == {"tests/a.py::test_maybe[p-1]"} and nodes["tests/a.py::test_x"] == "needs a thing"


def test_main_exit_codes_and_diff(tmp_path, capsys):
    expected, record = tmp_path / "expected.txt", tmp_path / "record.txt"
    expected.write_text(EXPECTED)
    assert main([str(expected), str(record)]) == 1  # no record: the suite did not run
    assert "no record of skipped tests" in capsys.readouterr().err
    record.write_text("tests/a.py::test_x  # r\ntests/b.py  # r\n")
    assert main([str(expected), str(record)]) == 0
    record.write_text("tests/a.py::test_x  # r\n")
    assert main([str(expected), str(record)]) == 1
    err = capsys.readouterr().err
    assert "- tests/b.py" in err and "update" in err
    assert main([str(expected)]) == 2


PLUGIN_CONFTEST = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
from skips import SkipRecord

def pytest_configure(config):
    config.pluginmanager.register(SkipRecord(), "adaspec-skip-record")
"""

SAMPLE_TESTS = """
import pytest

@pytest.mark.skip(reason="marked")
def test_marked():
    pass

def test_inside():
    pytest.skip("from inside")

@pytest.mark.parametrize("n", [1, 2])
def test_param(n):
    if n == 2:
        pytest.skip("two")

@pytest.mark.xfail(reason="an xfail is not a skip")
def test_xfail():
    assert False

def test_runs():
    pass
"""


def test_a_run_records_every_skip_with_xdist(tmp_path):
    """A pytest run with pytest-xdist (2 workers) writes one record from the controller: tests
    skipped by a mark, from inside and per parameter, and a module skipped at import."""
    (tmp_path / "conftest.py").write_text(PLUGIN_CONFTEST)
    (tmp_path / "test_sample.py").write_text(SAMPLE_TESTS)
    (tmp_path / "test_module.py").write_text('import pytest\npytest.importorskip("no_such_module_x")\n')
    record = tmp_path / "record.txt"
    env = {**os.environ, SKIPS_FILE_ENV: str(record), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    env.pop("PYTEST_XDIST_WORKER", None)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "xdist", "-n", "2", "-p", "no:cacheprovider",
                           str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:]
    nodes, _ = parse(record.read_text().splitlines())
    assert set(nodes) == {"test_module.py", "test_sample.py::test_marked", "test_sample.py::test_inside",
                          "test_sample.py::test_param[2]"}
    assert "marked" in nodes["test_sample.py::test_marked"] and "no_such_module_x" in nodes["test_module.py"]


def test_the_expected_list_names_tests_that_exist():
    """A renamed test would leave its entry behind (a "?" entry would then never fail)."""
    nodes, optional = parse((TESTS / "expected_skips.txt").read_text().splitlines())
    assert nodes and optional
    for node in nodes:
        path, _, name = node.partition("::")
        source = (TESTS.parent / path).read_text()
        assert not name or f"def {name.partition('[')[0]}(" in source, node
