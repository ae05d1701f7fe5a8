"""Datasets: the two formats, the JSONL reader and its row rules, prompts, answer grading, validation, the embedded task.

Bottom up: ``formats`` (names, row shape) <- ``answers`` (extract, grade) <- ``prompts`` <- ``jsonl`` (read files)
<- ``validate`` (Great Expectations); ``synth`` writes the embedded arithmetic task.
"""
