"""``python -m sessionstate.cli``: the ``sessionstate`` command."""

from sessionstate.cli import main

if __name__ == "__main__":  # not when a doctest run imports it
    raise SystemExit(main())
