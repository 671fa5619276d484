"""The output processor alone (scheduler_svc/output.py): text per token, one stop per session,
the held-back text at the end, logprob text, and no state left once sessions end."""

from __future__ import annotations

from scheduler_svc.core.types import SessionRequest, TokenLogprob
from scheduler_svc.output import LogprobText, OutputProcessor


class _Letters:
    """A stand-in text stream: token t is the letter chr(97 + t); "x" is a stop string; the
    last letter is held back until the next token (as a detokenizer holds an incomplete
    character)."""

    def __init__(self, stop: tuple[str, ...]) -> None:
        self.stop, self.held, self.stopped = stop, "", False

    def push(self, token: int) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        out, self.held = self.held, chr(97 + token)
        if self.held in self.stop:
            self.stopped = True
            return out, True
        return out, False

    def flush(self) -> str:
        return "" if self.stopped else self.held


def _processor() -> OutputProcessor:
    return OutputProcessor(lambda r: _Letters(r.stop_strings), lambda t: chr(97 + t))


def test_text_arrives_token_by_token_and_the_rest_at_the_finish() -> None:
    out = _processor()
    out.open("s", SessionRequest(prompt_ids=(1,), max_new_tokens=3))
    texts = [out.token("s", t, None).text for t in (0, 1, 2)]
    assert texts == ["", "a", "b"] and out.finish("s") == "c"
    assert out.held() == 0


def test_a_stop_string_is_reported_once_and_nothing_follows_it() -> None:
    out = _processor()
    out.open("s", SessionRequest(prompt_ids=(1,), max_new_tokens=9, stop_strings=("x",)))
    got = [out.token("s", t, None) for t in (0, 23, 1, 2)]  # a, x (stop), b, c
    assert [(g.text, g.stop_hit) for g in got] == [("", False), ("a", True), ("", False), ("", False)]
    assert out.finish("s") == ""  # nothing past the stop


def test_logprobs_carry_each_tokens_text() -> None:
    out = _processor()
    out.open("s", SessionRequest(prompt_ids=(1,), max_new_tokens=2))
    lp = out.token("s", 2, TokenLogprob(2, -0.5, ((2, -0.5), (3, -1.5)))).logprob
    assert lp == LogprobText(2, -0.5, "c", ((2, -0.5, "c"), (3, -1.5, "d")))


def test_sessions_that_end_without_a_finish_leave_nothing() -> None:
    out = _processor()
    for sid in ("a", "b"):
        out.open(sid, SessionRequest(prompt_ids=(1,), max_new_tokens=2))
    out.close("a")
    assert out.finish("b") == "" and out.held() == 0
    assert out.token("gone", 1, None).text == "" and out.finish("gone") == ""  # unknown: no text
