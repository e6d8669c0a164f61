"""`python -m app.cli`: the same as the `dsbd-chat` command."""

import sys

from app.cli import main

sys.exit(main())
