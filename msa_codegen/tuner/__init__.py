"""The autotuner: Optuna over the launch knobs, candidates checked against the reference.

    space.py    the knobs per direction, the search space and the prune filter
    measure.py  a problem's inputs, the correctness check and the timing of a candidate
    search.py   the Optuna study per key (shared through the database file) and the winner

Optuna is imported only when tuning starts. Tuning never runs on ``attention``'s path.
"""
from .measure import Bench, Problem, WrongResult
from .search import TuneResult, tune

__all__ = ["Bench", "Problem", "WrongResult", "TuneResult", "tune"]
