"""Every text course_utils shows a learner goes through its catalogs: a string literal with words in it, given to
print(), warnings.warn(), a raised exception, a plot's labels or a widget's description, sits inside _() or N_().
(The Chinese edition prints these; an unwrapped one comes out in English.)"""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "course_utils"
PROSE = re.compile(r"[A-Za-z]{2,}[^\S\n]+[A-Za-z]{2,}")
SHOWN_BY = {"print", "warn", "set_title", "set_xlabel", "set_ylabel", "suptitle", "xlabel", "ylabel", "title",
            "text", "annotate"}
SHOWN_AS = {"label", "title", "description", "xlabel", "ylabel", "placeholder", "tooltip"}
TRANSLATORS = {"_", "N_"}


def _unwrapped_texts(node: ast.AST) -> list[ast.Constant]:
    found = []

    def visit(n, wrapped):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in TRANSLATORS:
            wrapped = True
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and not wrapped and PROSE.search(n.value):
            found.append(n)
        for child in ast.iter_child_nodes(n):
            visit(child, wrapped)

    visit(node, False)
    return found


def unwrapped(source: str) -> list[tuple[int, str]]:
    """(line, text) of every shown string literal with words that no _() or N_() wraps."""
    hits = []
    for n in ast.walk(ast.parse(source)):
        shown = []
        if isinstance(n, ast.Raise) and isinstance(n.exc, ast.Call):
            shown = list(n.exc.args)
        elif isinstance(n, ast.Call):
            name = n.func.id if isinstance(n.func, ast.Name) else getattr(n.func, "attr", "")
            if name in SHOWN_BY:
                shown = list(n.args) if name == "print" else n.args[:1]
            shown += [k.value for k in n.keywords if k.arg in SHOWN_AS]
        for arg in shown:
            hits += [(c.lineno, c.value) for c in _unwrapped_texts(arg)]
    return hits


def test_every_shown_text_of_course_utils_is_translatable():
    offenders = []
    for module in sorted(PACKAGE.rglob("*.py")):
        if "locale" in module.parts:
            continue
        offenders += [f"{module.relative_to(ROOT)}:{line}: {text[:80]!r}"
                      for line, text in unwrapped(module.read_text(encoding="utf-8"))]
    assert not offenders, f"{len(offenders)} text(s) not wrapped in _():\n" + "\n".join(offenders)


def test_the_lint_finds_an_unwrapped_message_and_accepts_a_wrapped_one():
    source = '''
def f(n):
    if n < 0:
        raise ValueError(f"n must be positive, got {n}")
    print(_("all is well, {n}").format(n=n), "steps")
    warnings.warn(_("a wrapped warning"))
    ax.set_xlabel("batch size")
'''
    assert [line for line, _text in unwrapped(source)] == [4, 7]
