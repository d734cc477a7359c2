"""The design docs stay true to the tree: every path and module they name exists.

    docs/*.md and README.md -> every repository path they mention (`plait/...`, `tests/...`,
    `benchmarks/...`, `docs/...`, in prose, backticks or code blocks) -> exists in the checkout
                            -> every backticked dotted name `plait.a.b[.name]` -> a module
                               file or package, and a trailing name one its source defines
                               or imports

A file moved or renamed without its doc fails here, naming the doc, the line and the path.
Pure text and file checks: no import of plait, no torch; well under a second.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
PATH = re.compile(r"(?<![\w./-])((?:plait|tests|benchmarks|docs)/[\w./-]*[\w/])")
DOTTED = re.compile(r"`(plait(?:\.\w+)+)`")
PLACEHOLDERS = {"plait.X"}  # the porting rule's own notation: `torch.distributed.X` -> `plait.X`


def _mentions(pattern: re.Pattern, path: Path) -> list[tuple[int, str]]:
    """(line number, match) for each mention; a path followed by `<`, `{` or `*` is a pattern
    (`benchmarks/bench_<name>.py`), not a path."""
    return [(n, m.group(1)) for n, line in enumerate(path.read_text().splitlines(), 1)
            for m in pattern.finditer(line) if line[m.end():m.end() + 1] not in ("<", "{", "*")]


def _module_file(dotted: list[str]) -> Path | None:
    base = ROOT.joinpath(*dotted)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def unresolved_name(dotted: str) -> str | None:
    """None when `dotted` is a module, or a module and one name its source defines or
    imports; else what is missing."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        source = _module_file(parts[:cut])
        if source is None:
            continue
        rest = parts[cut:]
        if not rest:
            return None
        if len(rest) == 1 and re.search(rf"\b{re.escape(rest[0])}\b", source.read_text()):
            return None
        return f"{'.'.join(rest)} in {source.relative_to(ROOT)}"
    return f"no module {dotted}"


@pytest.mark.parametrize("doc", [*DOCS, ROOT / "README.md"], ids=lambda p: p.name)
def test_every_path_named_exists(doc):
    missing = [f"{doc.name}:{n}: {p}" for n, p in _mentions(PATH, doc) if not (ROOT / p).exists()]
    assert not missing, "paths named in the docs that are not in the tree:\n" + "\n".join(missing)


@pytest.mark.parametrize("doc", [*DOCS, ROOT / "README.md"], ids=lambda p: p.name)
def test_every_module_named_exists(doc):
    bad = [f"{doc.name}:{n}: `{d}` ({why})" for n, d in _mentions(DOTTED, doc)
           if d not in PLACEHOLDERS and (why := unresolved_name(d))]
    assert not bad, "modules named in the docs that are not in the tree:\n" + "\n".join(bad)


def test_the_readme_links_the_design_and_the_design_lists_every_doc():
    assert "docs/DESIGN.md" in (ROOT / "README.md").read_text()
    design = (ROOT / "docs" / "DESIGN.md").read_text()
    unlisted = [d.name for d in DOCS if f"docs/{d.name}" not in design]
    assert not unlisted, f"docs/DESIGN.md does not list {unlisted}"


def test_the_checks_see_a_missing_path_and_module():
    assert not (ROOT / "plait" / "activation_checkpoint.py").exists()
    assert PATH.findall("see `plait/activation_checkpoint.py` and tests/x/y.py.") == [
        "plait/activation_checkpoint.py", "tests/x/y.py"]
    doc = ROOT / "docs" / "DESIGN.md"
    assert "plait/comm/" in [p for _, p in _mentions(PATH, doc)]
    assert unresolved_name("plait.activation_checkpoint") == "activation_checkpoint in plait/__init__.py"
    assert unresolved_name("plait.activation_checkpoint.wrapper") == "activation_checkpoint.wrapper in plait/__init__.py"
    assert unresolved_name("plait.activation_checkpointing.wrapper") is None
    assert unresolved_name("plait.comm.no_such_name") == "no_such_name in plait/comm/__init__.py"
    assert unresolved_name("plait.comm.autograd") is None
    assert unresolved_name("plait.tensor.experimental.context_parallel") is None
