"""``python -m jetflow`` runs the command line."""

import sys

from jetflow.cli.main import main

sys.exit(main())
