import sys

from verl_mtp_plugin.cli import main

sys.exit(main())
