"""scripts/drafter_preferences.py: per-category drafting share, block, acceptance and drafter
shares from a rounds.csv (issue 20's two-backend comparison)."""
import csv
import gzip
import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "drafter_preferences.py"
spec = importlib.util.spec_from_file_location("drafter_preferences", SCRIPT)
prefs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(prefs)

FIELDS = ["config", "prompt_id", "category", "drafter", "drafted", "accepted"]
ROWS = [("AR", "qa-01", "qa", "none", 0, 0),
        ("auto", "qa-01", "qa", "none", 0, 0),
        ("auto", "qa-01", "qa", "suffix", 4, 1),
        ("auto", "rag-01", "rag", "prompt-lookup", 6, 6),
        ("auto", "rag-01", "rag", "suffix", 2, 0)]


def _write(path: Path) -> None:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(FIELDS)
        w.writerows(ROWS)


@pytest.mark.parametrize("name", ["rounds.csv", "rounds.csv.gz"])
def test_preferences_per_category(tmp_path, name):
    path = tmp_path / name
    _write(path)
    config, rows = prefs.read_rounds(path, None)
    assert config == "auto" and len(rows) == 4          # the first auto configuration only
    table = prefs.preferences(rows)
    assert table["qa"] == {"rounds": 2, "drafting": 0.5, "block": 4.0, "accepted": 0.25, "shares": {"suffix": 1.0}}
    assert table["rag"]["block"] == 4.0 and table["rag"]["accepted"] == 0.75
    assert table["rag"]["shares"] == {"prompt-lookup": 0.5, "suffix": 0.5}
    assert table["all"]["drafting"] == 0.75 and table["all"]["rounds"] == 4


def test_unknown_config_names_the_ones_there(tmp_path):
    path = tmp_path / "rounds.csv"
    _write(path)
    with pytest.raises(SystemExit, match="no configuration 'hedgespec'.*'AR', 'auto'"):
        prefs.read_rounds(path, "hedgespec")
