"""Safe to run and to stop: atomic writes, the project lock, no orphans, Ctrl-C, progress, threads, preflight; and the
host's CPU as /proc/cpuinfo describes it."""
