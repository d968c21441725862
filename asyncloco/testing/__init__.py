"""Test helpers that run as real processes (e.g. :mod:`asyncloco.testing.hostile`). Not used by runs."""
