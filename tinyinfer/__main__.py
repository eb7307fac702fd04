"""`python -m tinyinfer`: the `tinyinfer` command."""

import sys

from tinyinfer.cli import main

sys.exit(main())
