"""The sweep and what it decides: decoding passes, query-level routing, Pareto claims, report files, the promotion rule.

Bottom up: ``sweep_rows`` (the row type) <- ``passes`` <- ``query`` <- ``sweep``; ``pareto`` <- ``report``;
``promotion`` (pure functions: choose τ, compare with the champion, build the registry record).
"""
