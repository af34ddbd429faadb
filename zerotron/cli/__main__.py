"""``python -m zerotron.cli`` == the ``zerotron`` command."""
import sys

from .main import main

sys.exit(main())
