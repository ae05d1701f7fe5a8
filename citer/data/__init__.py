"""Datasets: the two formats, the JSONL reader and its row rules, prompts, answer grading, validation, the embedded task.

Bottom up: ``formats`` (names, row shape) <- ``answers`` (extract, grade) <- ``prompts`` <- ``origin`` (a row's file
and line) <- ``jsonl`` (read files) <- ``lengths`` (rows against a model's context) <- ``validate`` (Great
Expectations); ``synth`` writes the embedded arithmetic task.
"""
