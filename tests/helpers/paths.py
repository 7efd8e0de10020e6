"""Where the tests find the tree: the repository root, tests/ and its data."""

import os

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)
DATA = os.path.join(TESTS, "data")
