"""Entry point: `python app.py` starts the web UI (see README)."""

import sys

if __name__ == "__main__":
    sys.exit("The web UI is not built yet; use the Python API (see README.md).")
