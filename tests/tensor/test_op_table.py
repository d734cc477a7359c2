"""docs/dtensor-ops.md is the rule table as it is (python -m plait.tensor.ops.table)."""

from pathlib import Path

from plait.tensor.ops.table import render

DOC = Path(__file__).resolve().parents[2] / "docs" / "dtensor-ops.md"


def test_the_op_table_in_docs_is_current():
    assert DOC.read_text() == render(), "run: python -m plait.tensor.ops.table > docs/dtensor-ops.md"
