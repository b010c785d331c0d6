"""``python -m tensorkiln`` is the ``tensorkiln`` command."""

from tensorkiln.cli.main import main

raise SystemExit(main())
