"""Checkpoints, read in this order: `files.py` (the on-disk format: atomic writes, verified loads),
`checkpointer.py` (the collective save/resume of named Stateful objects), `rank_state.py` (the
per-rank states: RNG streams, a comm hook's), `train_states.py` (which of a run's objects are
saved, by name) and `resume.py` (pure rules for continuing at another world size)."""
