"""``python -m kvstore`` = the ``kvstore`` console script."""

import sys

from kvstore.cli import main

sys.exit(main())
