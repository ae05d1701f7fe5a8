"""What the embedded task says, so a question outside it is named instead of answered blindly.

The embedded pair is trained from scratch on :mod:`citer.data.synth`'s problems only: ten names, eight items, eight
verbs and a fixed frame (``Tom has 14 coins, sells 1, gives away 9 and gets 5. How many coins now?``), numbers up to
``synth.max_total``. Asked anything else it writes an answer of the task's shape that means nothing. Route and serve
cannot refuse such questions (a user may want to see what it does), but they say how many fall outside the task and
which words or numbers put them there.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from citer.data.synth import ADD_VERBS, ITEMS, NAMES, SUB_VERBS

FRAME = ("has", "and", "How", "many", "now")
TASK_WORDS = frozenset([*NAMES, *ITEMS, *FRAME, *(w for v in ADD_VERBS + SUB_VERBS for w in v.split())])


def outside_task(question: str, max_number: int) -> list[str]:
    """The words and numbers of ``question`` the embedded task never uses (numbers above ``max_number``)."""
    out = []
    for tok in re.findall(r"[A-Za-z]+|\d+", question):
        if tok.isdigit():
            if int(tok) > max_number:
                out.append(tok)
        elif tok not in TASK_WORDS:
            out.append(tok)
    return sorted(set(out))


def questions_outside_task(
    path: str | os.PathLike[str], fmt: str, max_number: int
) -> tuple[int, int, list[str]]:
    """(questions outside the task, questions read, a few of the words that put them there) of a JSONL file; lines
    that are not questions are left to the reader that routes them."""
    n = n_out = 0
    seen: list[str] = []
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            try:
                row: Any = json.loads(line)
                text = row["problem"] if fmt == "math" else row["question"]
            except (ValueError, KeyError, TypeError):
                continue
            if not isinstance(text, str):
                continue
            n += 1
            odd = outside_task(text, max_number)
            if odd:
                n_out += 1
                seen += [w for w in odd if w not in seen]
    return n_out, n, seen[:5]
