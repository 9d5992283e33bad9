"""``python -m relaunch``: the same as the ``relaunch`` command."""

from relaunch.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
