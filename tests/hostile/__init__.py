"""The hostile-input harness: structure-aware mutators, an oracle, a sentinel tree and every parser and CLI command
as a target (issue 9). ``tests/test_fuzz.py`` runs it under pytest; ``tests/hostile/run.py`` runs it for as long
as asked and prints per-target counts.
"""
