"""``python -m zerotron`` == the ``zerotron`` command."""
import sys

from .cli import main

sys.exit(main())
