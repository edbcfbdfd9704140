"""Every link between the documents (``docs/``, the README, the contributor notes) leads to
a file that exists and, with ``#anchor``, to a heading of it, as GitHub names headings."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCUMENTS = sorted([*ROOT.glob("*.md"), *(ROOT / "docs").rglob("*.md")])
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(document: pathlib.Path) -> set[str]:
    """The anchors GitHub gives the headings of ``document``: lower case, punctuation
    dropped, spaces as hyphens, ``-1``, ``-2`` after a repeated one; code blocks skipped."""
    found, fenced = set(), False
    for line in document.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        heading = re.match(r"#{1,6} +(.*?) *#*$", line)
        if heading and not fenced:
            text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.group(1))
            anchor = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
            name, k = anchor, 1
            while name in found:
                name, k = f"{anchor}-{k}", k + 1
            found.add(name)
    return found


def links() -> list[tuple[pathlib.Path, str]]:
    return [
        (document, target)
        for document in DOCUMENTS
        for target in LINK.findall(document.read_text())
        if not re.match(r"[a-z]+:", target)  # http:, https:, mailto: lead elsewhere
    ]


@pytest.mark.parametrize(
    "document, target", links(), ids=lambda x: x if isinstance(x, str) else x.name
)
def test_a_link_leads_to_a_file_and_heading_that_exist(document, target):
    path, _, anchor = target.partition("#")
    where = (document.parent / path).resolve() if path else document
    assert where.exists(), f"{document.relative_to(ROOT)} links to {target}: no such file"
    if anchor and where.suffix == ".md":
        assert anchor in anchors(where), (
            f"{document.relative_to(ROOT)} links to {target}: {where.name} has no such heading"
        )
