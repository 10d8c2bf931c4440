"""Exercises: (to come)."""

EXERCISES = ()
