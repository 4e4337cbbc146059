"""``python -m attnkit``: the same as the ``attnkit`` command."""

from __future__ import annotations

import sys

from .cli import main

sys.exit(main())
