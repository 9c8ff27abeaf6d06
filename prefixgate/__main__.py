"""`python -m prefixgate` is the `prefixgate` command."""

import sys

from prefixgate.cli import main

sys.exit(main())
