"""``python -m kvtransport``: the command line (:mod:`kvtransport.tools.cli`)."""

if __name__ == "__main__":
    from kvtransport.tools.cli import main

    raise SystemExit(main())
