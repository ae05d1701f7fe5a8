"""The one place prompts and targets are built.

Finetuning, label collection, evaluation, batch inference and serving all call these functions, so the text a model
is trained on is exactly the text it is later asked to continue.

- math: prompt ``"Question: {problem}\\nAnswer:"``, target ``" {solution}"`` (the solution ends in ``\\boxed{...}``).
- mc: the question and its lettered choices, then ``"Answer:"``; the target is ``" {cot}"`` when the row carries a
  chain of thought and otherwise ``" The answer is {answerKey}."``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from citer.data.answers import extract_boxed
from citer.data.formats import Format

ANSWER_CUE = "Answer:"

# The chat template the embedded tokenizer carries (a transformers Jinja template): the last user message is the
# question, then the answer cue. A message in the task's own form renders exactly build_prompt's text (math: the
# problem; mc: "question\nChoices: (A) x (B) y"), so a client that applies the tokenizer's template to a chat, as
# evaluation harnesses do before a raw completion, sends the prompt the models were trained on.
CHAT_TEMPLATE = (
    "{%- for m in messages if m['role'] == 'user' %}{%- if loop.last %}"
    "Question: {{ m['content'] | trim }}\n" + ANSWER_CUE + "{%- endif %}{%- endfor %}"
)


def mc_choices_text(choices: Mapping[str, Any]) -> str:
    """``(A) text (B) text ...`` on one line, in the row's label order."""
    return " ".join(f"({lab}) {txt}" for lab, txt in zip(choices["label"], choices["text"], strict=True))


def build_prompt(row: Mapping[str, Any], fmt: Format) -> str:
    """The text the model continues: the question (and choices) followed by the answer cue."""
    if fmt == "math":
        return f"Question: {row['problem']}\n{ANSWER_CUE}"
    if fmt == "mc":
        return f"Question: {row['question']}\nChoices: {mc_choices_text(row['choices'])}\n{ANSWER_CUE}"
    raise ValueError(f"unknown format {fmt!r}; expected 'math' or 'mc'")


def build_target(row: Mapping[str, Any], fmt: Format) -> str:
    """The reference continuation of :func:`build_prompt`: chain of thought ending in the answer."""
    if fmt == "math":
        return f" {row['solution']}"
    if fmt == "mc":
        cot = row.get("cot")
        if cot:
            return f" {cot}"
        return f" The answer is {row['answerKey']}."
    raise ValueError(f"unknown format {fmt!r}; expected 'math' or 'mc'")


def reference_answer(row: Mapping[str, Any], fmt: Format) -> str:
    """The gold answer string as grading expects it (math: the solution's last box; mc: the answer label)."""
    if fmt == "mc":
        return str(row["answerKey"])
    boxed = extract_boxed(str(row["solution"]))
    if boxed is None:
        raise ValueError("math row has no \\boxed{...} answer in its solution")
    return boxed
