import sys

from gpupipe.commands.cli import main

sys.exit(main())
