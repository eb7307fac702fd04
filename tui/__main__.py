"""`python -m tui [options]`: start the TUI without the tinyinfer command."""

import sys

from tui.cli import main

sys.exit(main())
