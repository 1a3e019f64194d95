"""``python -m lloyal`` runs the command line."""

from lloyal.cli import main

raise SystemExit(main())
