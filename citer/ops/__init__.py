"""What keeps a command safe to run and stop: atomic writes, the project lock, no orphaned children, Ctrl-C, progress
bars, torch threads and the checks before the first stage."""
