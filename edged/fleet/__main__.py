"""`python -m edged.fleet ...`: the same as `edgectl fleet ...` (what the tests start)."""

import sys

from edged.cli.fleet import main

sys.exit(main())
