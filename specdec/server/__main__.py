"""``python -m specdec.server --model M ...``: run the server (same flags as ``specdec serve``)."""
import sys

from specdec.server.cli import main

sys.exit(main())
