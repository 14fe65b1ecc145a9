"""CLAIMS.md and the notebooks agree: every claim a notebook cites is listed, every listed claim is cited (and so
checked live) by the notebook its row names, and every notebook that cites claims links the list."""
import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
ROW = re.compile(r"^\|\s*(\d+)\s*\|(.+)\|(.+)\|(.+)\|\s*$")
# "claim 5", "Claim 7,", "claims 1, 2 and 3", "**Claim\n12**"
CITATION = re.compile(r"\b[Cc]laims?\*{0,2}\s+\*{0,2}(\d+(?:\s*(?:,|and)\s*\d+)*)")
LINK = re.compile(r"\]\((?:\.\./)?CLAIMS\.md(?:#[^)]*)?\)")
# Notebooks edited elsewhere: their link to CLAIMS.md is expected from that work.


def listed_claims() -> dict[int, tuple[str, str, set[str]]]:
    """number -> (claim, verdict, notebook file names named in its "Checked live in" column)."""
    rows = {}
    for line in (ROOT / "CLAIMS.md").read_text().splitlines():
        match = ROW.match(line)
        if match:
            number, claim, verdict, where = int(match[1]), match[2].strip(), match[3].strip(), match[4]
            assert number not in rows, f"claim {number} is listed twice"
            rows[number] = (claim, verdict, set(re.findall(r"notebooks/(\d\d_\w+\.ipynb)", where)))
    return rows


def notebook_text(path: Path) -> str:
    return "\n".join(cell.source for cell in nbformat.read(path, as_version=4).cells)


def cited(text: str) -> set[int]:
    return {int(n) for group in CITATION.findall(text) for n in re.findall(r"\d+", group)}


CLAIMS = listed_claims()
CITED = {path.name: cited(notebook_text(path)) for path in NOTEBOOKS}


def test_citation_pattern_reads_every_form():
    assert cited("claims 1, 2 and 3 of the list; Claim 7, 'mixed'; **Claim\n12** says; claim 16 of") == {1, 2, 3, 7,
                                                                                                          12, 16}


def test_the_list_is_numbered_one_to_n_with_a_claim_a_verdict_and_a_notebook():
    assert sorted(CLAIMS) == list(range(1, len(CLAIMS) + 1)) and len(CLAIMS) >= 16
    names = {path.name for path in NOTEBOOKS}
    for number, (claim, verdict, where) in CLAIMS.items():
        assert claim and verdict, f"claim {number} lacks its text or its verdict"
        assert where and where <= names, f"claim {number}: no existing notebook named in {where}"


def test_every_cited_claim_is_listed():
    for name, numbers in CITED.items():
        assert numbers <= set(CLAIMS), f"{name} cites claims {sorted(numbers - set(CLAIMS))}, not in CLAIMS.md"


def test_every_listed_claim_is_checked_where_the_list_says():
    for number, (_, _, where) in CLAIMS.items():
        for name in where:
            assert number in CITED[name], f"CLAIMS.md says {name} checks claim {number}, but it does not cite it"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_a_notebook_that_cites_claims_links_the_list(path):
    if not CITED[path.name]:
        pytest.skip("cites no claim")
    assert LINK.search(notebook_text(path)), f"{path.name} cites claims but does not link ../CLAIMS.md"


def test_the_readme_links_the_list():
    assert LINK.search((ROOT / "README.md").read_text())
