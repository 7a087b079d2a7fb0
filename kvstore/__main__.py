"""`python -m kvstore` runs the command line."""

import sys

from kvstore.cli import main

sys.exit(main())
