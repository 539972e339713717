"""`python -m forkq` is the `forkq` command."""

import sys

from .cli import main

sys.exit(main())
