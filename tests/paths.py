"""Where the tests find the repository and their fixtures, wherever a test file sits in the tree."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
FIXTURES = TESTS / "fixtures"
