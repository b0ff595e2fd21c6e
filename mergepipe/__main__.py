import sys

from mergepipe.cli.app import main

sys.exit(main())
