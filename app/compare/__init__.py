"""Comparing decoding modes: records (a comparison, a prompt-set run, votes), the store beside the chat history,
tallies with intervals, the runner (a generator over prompt sets), the quality report and the bench.

The names below are the package's public surface, so callers may write `app.compare.ResultStore`."""

from app.compare.records import (BOTH_BAD, FORMAT_VERSION, LABELS, TIE, ResultsError, apply_vote, choices_of,
                                 load_prompt_source, needs_vote, new_comparison, new_run, pair_name, params_of_run,
                                 parse_prompts)
from app.compare.runner import (SetRunner, answer_all, generate_answer, iter_answers, iter_run, open_run, run_items)
from app.compare.stats import bench_runs, by_pair, mean_ci, mode_summary, pair_tallies, wilson
from app.compare.store import ResultStore, from_csv, read_export, to_csv, to_json

__all__ = ["BOTH_BAD", "FORMAT_VERSION", "LABELS", "TIE", "ResultsError", "ResultStore", "SetRunner", "answer_all",
           "apply_vote", "bench_runs", "by_pair", "choices_of", "from_csv", "generate_answer", "iter_answers",
           "iter_run", "load_prompt_source", "mean_ci", "mode_summary", "needs_vote", "new_comparison", "new_run",
           "open_run", "pair_name", "pair_tallies", "params_of_run", "parse_prompts", "read_export", "run_items",
           "to_csv", "to_json", "wilson"]
