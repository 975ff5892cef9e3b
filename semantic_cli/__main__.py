"""``python -m semantic_cli``: the ``semantic`` command."""

import sys

from semantic_cli.main import main

sys.exit(main())
