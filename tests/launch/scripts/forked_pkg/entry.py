"""`dpscale run -m forked_pkg.entry`: a module run as a script (tests/launch/test_forked_scripts.py)."""

import sys

if __name__ == "__main__":
    print("module", __name__, __file__.endswith("forked_pkg/entry.py"), sys.argv[1:], flush=True)
