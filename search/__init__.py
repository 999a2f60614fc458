"""The Optuna search for skip policies, installed as ``layerskip.search``: ``run_study`` runs one
from Python, ``layerskip-search`` from the command line. It imports layerskip, never the reverse."""

from layerskip.search.api import StudyResult, run_study
from layerskip.search.settings import PRESETS, SearchSettings

__all__ = ["PRESETS", "SearchSettings", "StudyResult", "run_study"]
