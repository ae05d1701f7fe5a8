"""Survivors of ``bench/mutation.py`` judged equivalent: no test can tell them from the original code.

``module -> {mutmut name: (the mutated line(s) as the report shows them, why it is equivalent)}``. The mutated text
is checked against the run, so after an edit renumbers a module's mutants a stale judgement is simply not applied.
"""

from __future__ import annotations

EQUIVALENT: dict[str, dict[str, tuple[str, str]]] = {}
