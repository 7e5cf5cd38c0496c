"""`python -m afd`: the `afd` command."""

import sys

from afd.entrypoints.cli import main

sys.exit(main())
