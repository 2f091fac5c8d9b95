"""``python -m meshtrain.cli ...`` runs the ``meshtrain`` command (what `meshtrain launch`
starts in each process)."""

import sys

from meshtrain.cli import main

sys.exit(main())
