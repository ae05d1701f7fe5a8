"""``python -m citer.cli``: the ``citer`` command."""

from citer.cli import main

main()
