"""``python -m inferlb``: the ``inferlb`` command (:func:`inferlb.ops.cli.main`)."""

from inferlb.ops.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
