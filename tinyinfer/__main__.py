"""`python -m tinyinfer` is the `tinyinfer` command."""

import sys

from tinyinfer.cli import main

sys.exit(main())
