"""``python -m fcaudit.cli`` (as ``python -m fcaudit``)."""

import sys

from fcaudit.cli import main

sys.exit(main())
