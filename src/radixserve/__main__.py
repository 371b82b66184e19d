"""``python -m radixserve`` = the ``radixserve`` console script."""

import sys

from radixserve.launch.cli import main

sys.exit(main())
