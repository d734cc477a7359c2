"""The design docs stay true to the tree: every path and module they name exists.

    docs/*.md and README.md -> every repository path they mention (`plait/...`, `tests/...`,
    `benchmarks/...`, `docs/...`, in prose, backticks or code blocks) -> exists in the checkout
                            -> every backticked dotted name `plait.a.b[.name]` -> a module
                               file or package, and a trailing name one its source defines
                               or imports
    docs/DESIGN.md's layer table -> each package's module-level plait imports are the ones
                                    its row lists (a layer reaching up, or a stale row, fails)

A file moved or renamed without its doc fails here, naming the doc, the line and the path.
Pure text and file checks: no import of plait, no torch; about half a second in all.
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


# -- the layer table of docs/DESIGN.md ("What each imports from plait") ---------------------------

NOT_LAYERS = {  # packages outside the table, and why
    "_composable", "algorithms", "elastic",  # thin twins of torch's paths: re-exports only
    "cli", "demo", "generate", "plot",       # entry points: they sit above everything
    "testing",                               # the test harness (plait.comm and torch)
}


def _layer(module: str) -> str | None:
    """plait.tensor.parallel.style -> "tensor.parallel"; plait.fsdp.fsdp1.api -> "fsdp"."""
    parts = module.split(".")
    if parts[0] != "plait" or len(parts) < 2:
        return None
    if parts[1] == "tensor" and len(parts) > 2 and parts[2] in ("parallel", "experimental"):
        return f"tensor.{parts[2]}"
    return parts[1]


STATEMENT = re.compile(r"^(?:from (plait[\w.]*) import (\([^)]*\)|[^\n]*)|import (plait[\w.]*))", re.M)


def _module_level_imports() -> dict[str, set[str]]:
    """layer -> the other layers its modules import at module level: the unindented import
    statements (one inside a function is indented). By text, not ast: 0.1 s, not 1 s."""
    found: dict[str, set[str]] = {}
    for path in (ROOT / "plait").rglob("*.py"):
        me = _layer(".".join(path.relative_to(ROOT).with_suffix("").parts))
        if me is None or me.startswith("__"):
            continue
        for source, names, module in STATEMENT.findall(path.read_text()):
            if source == "plait":  # from plait import comm, checkpoint as dcp
                names = re.sub(r"#[^\n]*", "", names).strip("()")
                targets = [f"plait.{n.split()[0]}" for n in names.split(",") if n.strip()]
            else:
                targets = [source or module]
            found.setdefault(me, set()).update(t for n in targets if (t := _layer(n)) and t != me)
    return found


def _layer_table() -> dict[str, set[str] | None]:
    """layer -> the layers its row allows at module level (None: "every layer below")."""
    text = (ROOT / "docs" / "DESIGN.md").read_text().split("What each imports from plait", 1)[1]
    rows: dict[str, set[str] | None] = {}
    for line in text.splitlines()[1:]:
        if not line.startswith("|") and rows:
            break
        cells = line.split("|")
        if len(cells) < 4 or not cells[1].strip().startswith("`plait."):
            continue
        allowed = None if "every layer" in cells[2] else {_layer(m) for m in DOTTED.findall(cells[2])}
        for name in DOTTED.findall(cells[1]):
            rows[_layer(name)] = allowed
    return rows


def test_every_package_imports_only_what_the_layer_table_says():
    table, actual = _layer_table(), _module_level_imports()
    assert len(table) >= 15, f"docs/DESIGN.md's layer table parsed to {len(table)} rows: {sorted(table)}"
    unlisted = sorted(set(actual) - set(table) - NOT_LAYERS)
    assert not unlisted, f"plait packages missing from docs/DESIGN.md's layer table: {unlisted}"
    wrong = {layer: sorted(actual.get(layer, set()) - allowed - {layer})
             for layer, allowed in table.items() if allowed is not None}
    wrong = {k: v for k, v in wrong.items() if v}
    assert not wrong, ("imports at module level that docs/DESIGN.md's layer table does not list "
                       f"(a layer reaching up, or a row to update): {wrong}")
