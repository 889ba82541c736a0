"""Tolerant numeric answer extraction and exact-match rewards (arithmetic, GSM8K).

A model states a number in many ways: ``1,080``, ``$18.``, ``-3``, ``0.50``, ``3/4``,
``#### 18``, ``The answer is 18``, ``\\boxed{18}``, or as the last number of a worked
solution. `extract_numeric_answer` finds the intended final number with these rules, in
order of precedence (the first rule that matches decides):

1. the last ``#### N`` (GSM8K's own convention);
2. the last ``\\boxed{N}``;
3. the last ``answer is N`` / ``answer: N`` (any case), N right after the marker;
4. the last number anywhere in the text.

Numbers are read as exact `fractions.Fraction`\\ s: thousands separators (``1,000,000``)
and currency signs are dropped, a trailing period is punctuation, ``0.5`` and ``1/2`` are
both one half. A minus sign counts only where it cannot be a binary operator (``5-3``
ends with the number 3, not -3). `numeric_reward` compares exactly when the gold answer
is an integer, else within a tiny relative tolerance so that a long decimal expansion of
a fraction (``0.3333333333`` for 1/3) still matches.

Answer matchers ``(completion, example) -> float`` compare the stated answer with
``example["answer"]`` (`MATCHERS` names them for ``reward=<name>``). The strict ones read
one format and demand that its content be the answer and nothing else (as strict-match
evaluation harnesses do): `boxed_match` (the last ``\\boxed{...}``), `hashes_match` (the
rest of the line after the last ``####``), `answer_tag_match` (the last
``<answer>...</answer>``). The lenient ones find the answer wherever it is stated:
`last_number_match` (the last number anywhere) and `lenient_match` (inside an ``<answer>``
tag when there is one, else the whole completion; numbers by the precedence rules above,
text answers by case-insensitive equality of the tag, box or ``####`` content, else of the
last line). A gold answer that is one number is compared as a number (``$1,080.`` states
1080; ``18 eggs`` states it only to the lenient matchers), any other as text (whitespace
collapsed; case kept by the strict matchers).

Every function here is total on strings: malformed model output gives ``None`` or a
reward of 0.0, never an exception.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

__all__ = ["DEFAULT_REL_TOL", "MATCHERS", "answer_tag_match", "answers_match", "boxed_match",
           "extract_answer_tag", "extract_boxed", "extract_hashes", "extract_numeric_answer",
           "find_numbers", "hashes_match", "last_number_match", "lenient_match",
           "numbers_match", "numeric_reward", "parse_number"]  # fmt: skip

#: Relative tolerance of `numbers_match` for non-integer gold answers:
#: |a - b| <= tol * max(1, |b|).
DEFAULT_REL_TOL = 1e-6

# Markers of one kind (and, for the last-number rule, number segments) tried from the end
# of a text before that rule gives up: a text whose last 64 "####" (or boxes, or "answer
# is", or segments) hold no valid number states no answer that way. Only hostile text
# (thousands of `\boxed{1/0}`) gets there; the bound keeps it within the time budget.
_MAX_MARKERS = 64

# Longest digit run read as a number: bounds the work on adversarial output (Python also
# refuses int() of more than 4300 digits) and no real answer comes close.
_MAX_DIGITS = 60

# One number: an optional minus sign written against the digits (whether it is a sign or
# a binary operator is decided from the text before it, see `_is_sign`), an optional
# currency sign, the integer part with or without thousands separators, an optional
# decimal part, an optional "/denominator". The lookahead demands a digit.
_NUMBER_RE = re.compile(
    r"(?P<sign>-)?\$?(?=\.?\d)"
    r"(?P<int>\d{1,3}(?:,\d{3})+(?!\d)|\d+)?"
    r"(?:\.(?P<dec>\d+))?"
    r"(?:\s?/\s?(?P<den>\d+))?"
)
# Markers after which the answer must follow at once (spaces, colons and markdown bold
# skipped): "Answer: Janet has 16 eggs ... 18" is read by the last-number rule instead.
# Each pattern matches exactly the markers that a number follows (the lookahead is
# `_NUMBER_RE`'s own start), so a text full of bare markers yields no matches to loop over.
_NUMBER_START = r"(?=-?\$?\.?\d)"
# "####" runs: the non-overlapping scan reads only the last "####" of a run, and only a run
# whose length is a multiple of four is followed by something other than "#".
_HASHES_RE = re.compile(r"#(?<!##)###(?:####)*(?!#)[\s*]*" + _NUMBER_START)
_ANSWER_IS_RE = re.compile(r"answer\s*(?:is\b|:)[\s*:]*" + _NUMBER_START, re.IGNORECASE)
# A box without a digit holds no number.
_BOXED_RE = re.compile(r"\\boxed\s*\{([^{}\d]*\d[^{}]*)\}")

# The last-number rule reads the text backwards, one segment at a time, so it touches only
# the end of a long text. A segment starts at a cut: a place between two characters that
# no number match can span (a letter, a "+", two spaces, a "-" after a digit, ...), so the
# left-to-right scan of `_NUMBER_RE` from a cut sees exactly the matches that the scan of
# the whole text sees there. `_REV_RUN_RE` runs over the reversed text from a segment's
# last digit and stops at the first cut: each alternative admits a character only next to
# a character it can share a match with (a "," only before three digits, a space only next
# to "/", a "-" only as a sign).
_REV_RUN_RE = re.compile(
    r"\d(?:(?<=[\d,./\s])\d+|(?<=\d\d\d),|(?<=\d)\.|(?<=\d)\s(?=/)|(?<=/)\s"
    r"|(?<=[\s\d])/|(?<=[.\d])\$|(?<=[$.\d])-)*"
)
_REV_NON_DIGITS_RE = re.compile(r"\D*")
# Longest segment read whole. Only adversarial text has longer ones (a 5,000-character
# chain such as "1/2/3/..." or "1.1.1..."); there the segment is read from this many
# characters before its end, which bounds the work and may split its first number.
_MAX_SEGMENT = 4096


def _to_text(value) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, str):
        return value
    item = getattr(value, "item", None)  # numpy scalars / 0-d arrays of bytes or str.
    return _to_text(item()) if callable(item) else str(value)  # (Or a plain number.)


def _is_sign(text: str, start: int) -> bool:
    """Whether the "-" at `start` is a sign rather than a binary minus: it is a binary
    minus after a digit, a closing bracket or a percent sign (spaces skipped), so "5 - 3"
    and "5-3" end with the number 3 while "is -3" and "(-3" hold -3."""
    i = start - 1
    while i >= 0 and start - i <= 8 and text[i] in " \t":
        i -= 1
    return i < 0 or not (text[i].isdigit() or text[i] in ")]}%")


def _number_from_match(text: str, match: re.Match) -> Fraction | None:
    int_part, dec, den = match.group("int"), match.group("dec"), match.group("den")
    digits = (int_part or "").replace(",", "")
    if len(digits) + len(dec or "") + len(den or "") > _MAX_DIGITS:
        return None
    if den is not None and not den.strip("0"):
        return None  # before any Fraction work: texts can hold thousands of "n/0"
    value = Fraction(int(digits or "0"))
    if dec is not None:
        value += Fraction(int(dec), 10 ** len(dec))
    if den is not None:
        value /= int(den)
    if match.group("sign") and _is_sign(text, match.start()):
        return -value
    return value


def _iter_numbers(text: str):
    for match in _NUMBER_RE.finditer(text):
        value = _number_from_match(text, match)
        if value is not None:
            yield value


def _last_number(text: str) -> Fraction | None:
    """``find_numbers(text)[-1]`` (None if empty), in time proportional to the segments read
    from the end (see `_REV_RUN_RE`) rather than to the whole text; None if the last
    `_MAX_MARKERS` segments hold no valid number."""
    rev, n = text[::-1], len(text)
    end = n
    for _ in range(_MAX_MARKERS):
        if end <= 0:
            break
        end = n - _REV_NON_DIGITS_RE.match(rev, n - end).end()  # just after the last digit
        if end == 0:
            return None
        run = _REV_RUN_RE.match(rev, n - end, n - end + _MAX_SEGMENT)
        start = end - (run.end() - run.start())
        for match in reversed(list(_NUMBER_RE.finditer(text, start, end))):
            value = _number_from_match(text, match)
            if value is not None:
                return value
        end = start
    return None


def find_numbers(text) -> list[Fraction]:
    """All numbers in `text`, in order, as exact fractions.

    Args:
      text: any string (bytes are decoded as UTF-8).

    Returns:
      The numbers found; an empty list if there are none.
    """
    return list(_iter_numbers(_to_text(text)))


def parse_number(text) -> Fraction | None:
    """Reads one number written in `text` (e.g. a gold answer such as ``"1,080"`` or ``"-3"``).

    Surrounding whitespace, a currency sign, a trailing period or percent sign are
    ignored. If the text holds several numbers, the last one is returned.

    Args:
      text: a string, bytes, or a number.

    Returns:
      The number as a `Fraction`, or None if `text` holds no number.
    """
    if isinstance(text, bool):
        return None
    if isinstance(text, int | Fraction):
        return Fraction(text)
    if isinstance(text, float):
        return Fraction(text) if math.isfinite(text) else None
    return _last_number(_to_text(text))


def _number_at(text: str, start: int) -> Fraction | None:
    match = _NUMBER_RE.match(text, start)
    return None if match is None else _number_from_match(text, match)


def _last_matches(pattern: re.Pattern, text: str) -> list[re.Match]:
    """The last `_MAX_MARKERS` matches of `pattern` in `text`, the last first."""
    return list(pattern.finditer(text))[-_MAX_MARKERS:][::-1]


def extract_numeric_answer(text) -> Fraction | None:
    """The final numeric answer stated in `text`, by the precedence rules of this module.

    Args:
      text: model output or a gold solution (str or bytes).

    Returns:
      The answer as a `Fraction`, or None if no rule finds a number.
    """
    try:
        text = _to_text(text)
        for pattern in (_HASHES_RE, _BOXED_RE, _ANSWER_IS_RE):  # The rules, in precedence.
            for match in _last_matches(pattern, text):
                if pattern is _BOXED_RE:
                    value = next(_iter_numbers(match.group(1)), None)
                else:
                    value = _number_at(text, match.end())
                if value is not None:
                    return value
        return _last_number(text)
    except Exception:  # model output must never crash a reward
        return None


def numbers_match(value: Fraction, gold: Fraction, *, rel_tol: float = DEFAULT_REL_TOL) -> bool:
    """Whether `value` equals `gold`: exactly when `gold` is an integer (so 2880001 never
    passes for 2880000), else within ``rel_tol * max(1, |gold|)``.

    Args:
      value: the stated number.
      gold: the reference number.
      rel_tol: relative tolerance for a non-integer `gold`, >= 0 (0 means exact).

    Returns:
      True if the numbers match.
    """
    if value == gold:
        return True
    if Fraction(gold).denominator == 1:
        return False
    return abs(value - gold) <= Fraction(rel_tol) * max(1, abs(gold))


def _score(completion, read, accept=bool) -> float:
    """1.0 if ``read(text)`` of the completion's text is not None and `accept` takes it;
    0.0 otherwise, for a completion that is not str or bytes, and when either raises."""
    if not isinstance(completion, str | bytes):
        return 0.0
    try:
        stated = read(_to_text(completion))
        return 1.0 if stated is not None and accept(stated) else 0.0
    except Exception:  # model output must never crash a reward
        return 0.0


def numeric_reward(completion, gold, *, rel_tol: float = DEFAULT_REL_TOL) -> float:
    """1.0 if the final number stated in `completion` equals `gold`, else 0.0.

    Args:
      completion: model output (str or bytes); anything else scores 0.0.
      gold: the reference answer: a number, or text such as ``"1,080"`` or ``"#### 18"``.
      rel_tol: relative tolerance of the comparison (see `numbers_match`).

    Returns:
      1.0 or 0.0. Never raises on any completion.

    Raises:
      ValueError: if `gold` holds no number (a data error, not a model error).
    """
    gold_value = parse_number(gold)
    if gold_value is None:
        raise ValueError(f"The gold answer {gold!r} holds no number.")
    return _score(
        completion, extract_numeric_answer, lambda v: numbers_match(v, gold_value, rel_tol=rel_tol)
    )


# ---------------------------------------------------------------------------------------
# Answer matchers: (completion, example) -> float against example["answer"].


_BRACE_RE = re.compile(r"[{}]")


def extract_boxed(text) -> str | None:
    """The content of the last ``\\boxed{...}`` in `text` (nested braces kept, so
    ``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``); None if there is no closed box."""
    text = _to_text(text)
    # A box that never closes holds every later "{": an earlier box can only close before
    # it starts, so each box is scanned up to the start of the one after it (linear time).
    start = end = len(text)
    for _ in range(_MAX_MARKERS):
        start = text.rfind("\\boxed", 0, start)
        if start < 0:
            return None
        i = start + len("\\boxed")
        while i < end and text[i] == " ":
            i += 1
        if i < end and text[i] == "{":
            depth = 0
            for brace in _BRACE_RE.finditer(text, i, end):
                depth += 1 if brace.group() == "{" else -1
                if depth == 0:
                    return text[i + 1 : brace.start()]
            end = start
    return None


def extract_hashes(text) -> str | None:
    """The rest of the line after the last ``####`` (GSM8K's answer line), stripped; None if
    there is no ``####``."""
    text = _to_text(text)
    start = text.rfind("####")
    if start < 0:
        return None
    return text[start + 4 :].split("\n", 1)[0].strip()


def extract_answer_tag(text, tag: str = "answer") -> str | None:
    """The content of the last ``<tag>...</tag>`` in `text`, stripped; None if there is none."""
    text = _to_text(text)
    end = text.rfind(f"</{tag}>")
    start = text.rfind(f"<{tag}>", 0, max(end, 0))
    if end < 0 or start < 0:
        return None
    return text[start + len(tag) + 2 : end].strip()


def _normalise(text: str, *, casefold: bool = False) -> str:
    text = " ".join(text.split())
    return text.casefold() if casefold else text


def _whole_number(text: str) -> Fraction | None:
    """The number `text` consists of (a trailing period or percent sign allowed), else None."""
    text = text.strip()
    if text[-1:] in (".", "%"):
        text = text[:-1]
    match = _NUMBER_RE.fullmatch(text)
    return None if match is None else _number_from_match(text, match)


def _gold(example) -> tuple[str, Fraction | None]:
    """(the gold answer as text, its value if it is one number)."""
    gold = example["answer"]
    if isinstance(gold, int | float | Fraction) and not isinstance(gold, bool):
        return str(gold), parse_number(gold)
    text = _to_text(gold)
    return text, _whole_number(text)


def answers_match(
    stated, gold, *, casefold: bool = False, rel_tol: float = DEFAULT_REL_TOL
) -> bool:
    """Whether the answer text `stated` is the answer `gold`: as numbers (`numbers_match`)
    when `gold` is one number and `stated` is one number, else as text with whitespace
    collapsed (and case folded if `casefold`)."""
    gold_text, gold_value = _gold({"answer": gold})
    stated = _to_text(stated)
    if gold_value is not None:
        value = _whole_number(stated)
        return value is not None and numbers_match(value, gold_value, rel_tol=rel_tol)
    return _normalise(stated, casefold=casefold) == _normalise(gold_text, casefold=casefold)


def _strict(extract, completion, example) -> float:
    gold = example["answer"]
    return _score(completion, extract, lambda stated: answers_match(stated, gold))


def boxed_match(completion, example) -> float:
    """Strict: 1.0 if the last ``\\boxed{...}`` holds exactly ``example["answer"]``."""
    return _strict(extract_boxed, completion, example)


def hashes_match(completion, example) -> float:
    """Strict: 1.0 if the line after the last ``####`` is exactly ``example["answer"]``."""
    return _strict(extract_hashes, completion, example)


def answer_tag_match(completion, example) -> float:
    """Strict: 1.0 if the last ``<answer>...</answer>`` holds exactly ``example["answer"]``."""
    return _strict(extract_answer_tag, completion, example)


def last_number_match(completion, example) -> float:
    """Lenient: 1.0 if the last number anywhere in the completion is ``example["answer"]``.

    Raises:
      ValueError: if the gold answer holds no number (a data error).
    """
    gold_text, gold_value = _gold(example)
    if gold_value is None:
        gold_value = parse_number(gold_text)
    if gold_value is None:
        raise ValueError(f"The gold answer {gold_text!r} holds no number.")
    return _score(completion, _last_number, lambda value: numbers_match(value, gold_value))


def lenient_match(completion, example) -> float:
    """Lenient: the answer wherever it is stated (see the module docstring); the default
    reward of a JSONL task."""
    gold_text, gold_value = _gold(example)

    def judge(text: str) -> bool | float:
        tagged = extract_answer_tag(text)
        if gold_value is not None:
            return numeric_reward(text if tagged is None else tagged, gold_value)
        for extract in (extract_answer_tag, extract_boxed, extract_hashes):
            stated = extract(text)
            if stated is not None:
                return answers_match(stated, gold_text, casefold=True)
        lines = text.strip().splitlines() or [""]
        return answers_match(lines[-1], gold_text, casefold=True)

    return _score(completion, judge)


#: The built-in matchers by short name, for ``reward=<name>`` (the only list of them).
MATCHERS = {
    "boxed": boxed_match,
    "hashes": hashes_match,
    "answer_tag": answer_tag_match,
    "last_number": last_number_match,
    "lenient": lenient_match,
}
