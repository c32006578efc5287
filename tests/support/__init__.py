"""Helpers shared by the tests (not part of the installed package)."""
