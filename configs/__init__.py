"""Experiment configs (ml_collections); base.py holds every key."""
