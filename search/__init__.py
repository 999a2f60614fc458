"""Optuna search for skip policies; imports layerskip, never the reverse."""
