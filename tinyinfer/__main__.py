"""`python -m tinyinfer`: the `tinyinfer` command."""

import sys

from tinyinfer.cli.commands import main

sys.exit(main())
