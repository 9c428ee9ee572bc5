"""``python -m drsvc.replication.receiver``: the command deployed authorized_keys lines run."""
import sys

from .program import main

sys.exit(main())
