"""Progress: plain timestamped lines when the stream is no terminal, a tqdm bar with an ETA on one."""

import io
import re

from kvfleet.progress import Progress


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_plain_lines_count_and_estimate_the_rest():
    out, clock = io.StringIO(), _Clock()
    with Progress("sweep", stream=out, tty=False, clock=clock) as p:
        p.set_total(4)
        p("reference outputs")
        clock.t += 2
        p.advance(message="concurrency 1")
        clock.t += 2
        p.advance(message="concurrency 2")
        clock.t += 4
        p.advance(2, message="concurrency 8")
    lines = out.getvalue().splitlines()
    assert lines == [
        "[   0.0s] sweep: reference outputs",
        "[   2.0s] sweep 1/4 (25%, eta 6s): concurrency 1",
        "[   4.0s] sweep 2/4 (50%, eta 4s): concurrency 2",
        "[   8.0s] sweep 4/4 (100%): concurrency 8",
    ]
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()


def test_plain_lines_without_messages_every_n_units_and_at_the_end():
    out = io.StringIO()
    p = Progress("soak", total=7, stream=out, tty=False, line_every=3)
    for _ in range(7):
        p.advance()
    counts = [re.search(r"soak (\d+)/7", line).group(1) for line in out.getvalue().splitlines()]
    assert counts == ["3", "6", "7"]


def test_a_terminal_gets_a_tqdm_bar_with_an_eta():
    out = io.StringIO()
    with Progress("bench", total=3, stream=out, tty=True) as p:
        p.advance(message="cluster-1w c=1")
        p.note("starting the peer")
    text = out.getvalue()
    assert "\r" in text and "bench:" in text and "1/3" in text
    assert re.search(r"<\d\d:\d\d", text) or "<?" in text  # tqdm's remaining-time field
    assert "starting the peer" in text


def test_silent_progress_writes_nothing(capsys):
    with Progress.silent() as p:
        p.set_total(2)
        p("nothing")
        p.note("still nothing")
        p.advance(message="one")
        p.advance()  # reaching the total writes a final line on a real stream; not here
    assert capsys.readouterr() == ("", "")
    assert p.done == 2  # it still counts, it only stays quiet
