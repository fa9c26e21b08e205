"""StopChecker: stop tokens, eos, stop strings (cut and held back), max_tokens, max_model_len."""

from __future__ import annotations

from engine.core.request import Request, RequestStatus
from engine.core.stop_checker import StopChecker
from vocabulary.sampling import SamplingParams

EOS = 1


class FakeText:
    """Token t decodes to TEXT[t] (a multi-byte character may come as "" then the char)."""

    TEXT = {10: "Hel", 11: "lo", 12: " wor", 13: "ld", 14: "!", 15: "", 16: "é", EOS: ""}

    def push(self, token_id: int) -> str:
        return self.TEXT[token_id]


def make_checker(max_model_len: int = 100, **params: object) -> tuple[StopChecker, Request]:
    request = Request("r1", (0, 5), SamplingParams(**params), 4, b"")  # type: ignore[arg-type]
    return StopChecker(FakeText(), (EOS,), max_model_len), request


def feed(checker: StopChecker, request: Request, tokens: list[int]) -> list[tuple[str, object]]:
    """(released text, status) after each token."""
    steps: list[tuple[str, object]] = []
    for t in tokens:
        request.append_output(t, None)
        status = checker.update(request, t)
        steps.append((checker.take_text_delta(request, finished=status is not None), status))
        if status is not None:
            break
    return steps


def test_eos_stops_and_adds_no_text() -> None:
    checker, request = make_checker()
    assert feed(checker, request, [10, EOS]) == [
        ("Hel", None),
        ("", RequestStatus.FINISHED_STOPPED),
    ]
    assert request.output_token_ids == [10, EOS] and request.stop_reason is None


def test_ignore_eos_keeps_going() -> None:
    checker, request = make_checker(ignore_eos=True, max_tokens=3)
    assert [s for _, s in feed(checker, request, [EOS, EOS, 10])] == [
        None,
        None,
        RequestStatus.FINISHED_LENGTH,
    ]


def test_stop_token_id_stops_and_is_the_stop_reason() -> None:
    checker, request = make_checker(stop_token_ids=(11,))
    assert feed(checker, request, [10, 11]) == [("Hel", None), ("", RequestStatus.FINISHED_STOPPED)]
    assert request.stop_reason == 11


def test_stop_string_across_tokens_is_cut_and_never_released() -> None:
    checker, request = make_checker(stop=("o w",))
    # "o w" is 3 chars: the last 2 chars of the text are held back while running.
    assert feed(checker, request, [10, 11, 12]) == [
        ("H", None),
        ("el", None),
        ("l", RequestStatus.FINISHED_STOPPED),
    ]
    assert checker.text == "Hell" and request.stop_reason == "o w"


def test_earliest_of_several_stop_strings_wins() -> None:
    checker, request = make_checker(stop=("ld", "wor"))
    assert feed(checker, request, [10, 11, 12, 13])[-1] == ("lo ", RequestStatus.FINISHED_STOPPED)
    assert request.stop_reason == "wor"


def test_held_back_text_is_flushed_at_finish() -> None:
    checker, request = make_checker(stop=("xyz",), max_tokens=2)
    assert feed(checker, request, [10, 11]) == [
        ("H", None),
        ("ello", RequestStatus.FINISHED_LENGTH),
    ]


def test_incomplete_character_adds_no_text_until_complete() -> None:
    checker, request = make_checker()
    assert feed(checker, request, [15, 16]) == [("", None), ("é", None)]


def test_max_model_len_ends_with_length() -> None:
    checker, request = make_checker(max_model_len=4)  # 2 prompt tokens + 2 outputs
    assert [s for _, s in feed(checker, request, [10, 11])] == [
        None,
        RequestStatus.FINISHED_LENGTH,
    ]
