"""``python -m radixserve`` = the ``radixserve`` console script."""

import sys

from radixserve.cli import main

sys.exit(main())
