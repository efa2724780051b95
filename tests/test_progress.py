"""Progress of long commands: plain lines when stderr is not a terminal, throttled, first and last kept."""

import io

from rich.console import Console

from adaspec.cli.progress import StageProgress


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def plain(interval: float = 5.0) -> tuple[StageProgress, io.StringIO, FakeClock]:
    buf, clock = io.StringIO(), FakeClock()
    console = Console(file=buf, force_terminal=False, width=60)
    return StageProgress(console, interval=interval, clock=clock), buf, clock


def test_plain_lines_first_throttled_and_last():
    bar, buf, clock = plain(interval=5.0)
    with bar:
        for i in range(1, 11):
            clock.t = float(i)  # one second per item
            bar("distill", i, 10, f"item {i}")
    lines = buf.getvalue().splitlines()
    # first item, then at most one line every 5 s, and always the last
    assert lines[0].startswith("[0:00:01] distill: 1/10 (10%)") and lines[0].endswith("item 1")
    assert lines[-1].startswith("[0:00:10] distill: 10/10 (100%)")
    assert [line.split(": ")[1].split(" ")[0] for line in lines] == ["1/10", "6/10", "10/10"]
    assert "~0:00:" in lines[1]  # an estimate of the time left while running


def test_step_counts_items_and_lines_are_unwrapped():
    bar, buf, clock = plain(interval=0.0)
    long_detail = "x" * 200
    with bar:
        for _ in range(3):
            bar.step("bench", long_detail, total=3)
        bar.message("done")
    lines = buf.getvalue().splitlines()
    assert [line.split("] ")[1].split("  ")[0] for line in lines[:3]] == [
        "bench: 1/3 (33%)", "bench: 2/3 (67%)", "bench: 3/3 (100%)"]
    assert lines[0].endswith(long_detail) and lines[-1] == "done"


def test_terminal_draws_a_bar_not_lines():
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=80)
    with StageProgress(console) as bar:
        bar("train", 1, 2)
        bar("train", 2, 2)
    assert "train: 1/2" not in buf.getvalue()  # the rich bar, not the plain log lines
