"""`python -m lessons`: the course's command line, the same as `tinyinfer lesson`."""

import sys

from lessons.course import main

sys.exit(main())
