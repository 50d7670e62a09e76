"""``python -m kvtransport``: the command line (:mod:`kvtransport.tools.cli`)."""

from kvtransport.tools.cli import main

raise SystemExit(main())
