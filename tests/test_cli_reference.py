"""docs/cli.md is the commands' own help: regenerate it when a flag changes."""

from pathlib import Path

import pytest

from zsim.cli.reference import render


@pytest.mark.consistency
def test_the_reference_page_is_current():
    page = (Path(__file__).parent.parent / "docs" / "cli.md").read_text(encoding="utf-8")
    assert page == render(), "run: python -m zsim.cli.reference > docs/cli.md"
