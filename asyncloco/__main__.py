"""``python -m asyncloco ...`` is the ``asyncloco`` command (torchrun starts peers this way: ``-m asyncloco``)."""

import sys

from asyncloco.cli import main

if __name__ == "__main__":
    sys.exit(main())
