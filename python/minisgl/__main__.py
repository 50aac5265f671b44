"""`python -m minisgl --model PATH`: the server (chapter 15)."""

import sys

from minisgl.server.launch import main

if __name__ == "__main__":
    sys.exit(main())
