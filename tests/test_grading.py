"""The code grader: hidden tests run against an answer's code, and the code suite's self-check."""

from __future__ import annotations

from app.compare.bench import load_suite
from app.compare.grading import extract_code, grade
from helpers import ADD_TASK


def test_grader_passes_a_correct_solution_in_a_code_block():
    answer = "Sure:\n```python\ndef add(a, b):\n    return a + b\n```\nDone. ```python\nbroken(\n```"
    assert grade(answer, ADD_TASK)


def test_grader_fails_a_wrong_solution():
    assert not grade("```python\ndef add(a, b):\n    return a - b\n```", ADD_TASK)


def test_grader_times_out_an_infinite_loop():
    assert not grade("```python\ndef add(a, b):\n    while True:\n        pass\n```", ADD_TASK, timeout=1.0)


def test_grader_takes_the_whole_answer_without_a_code_block():
    assert grade("def add(a, b):\n    return a + b\n", ADD_TASK)
    assert not grade("The answer is a + b.", ADD_TASK)  # prose is a syntax error, not a crash of ours


def test_grader_takes_a_block_cut_off_by_max_tokens():
    assert extract_code("x\n```python\ndef add(a, b):\n    return a + b\n") == "def add(a, b):\n    return a + b\n"


def test_code_suite_loads_and_every_reference_passes_its_tests():
    tasks = load_suite("code")
    assert len(tasks) >= 20
    for t in tasks:
        assert f"`{t['entry_point']}(" in t["prompt"] and t["tests"]
        assert grade(f"```python\n{t['reference']}```", t), t["entry_point"]
        assert t["entry_point"] in t["reference"]
