"""docs/SECURITY.md is held to its word: every promise names the tests that hold it, and every
test it names exists. A promise whose tests were renamed or deleted fails here, so the
document cannot drift into promises nothing checks."""

from __future__ import annotations

import re

from tests.support import REPO

DOC = REPO / "docs" / "SECURITY.md"
CITATION = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")


def promises() -> list[str]:
    """The bullets of the "Promises" section, each as one string."""
    section = DOC.read_text().split("## Promises", 1)[1].split("\n## ", 1)[0]
    return [b.strip() for b in re.split(r"\n(?=- \*\*)", section) if b.strip().startswith("- **")]


def test_every_promise_names_its_tests() -> None:
    found = promises()
    assert len(found) >= 15, f"only {len(found)} promises found: the section's shape changed?"
    for promise in found:
        title = promise.split("**")[1]
        assert "Tests:" in promise and CITATION.search(promise), f"{title!r} names no test"


def test_every_named_test_exists() -> None:
    missing = []
    for promise in promises():
        for path, name in CITATION.findall(promise):
            source = REPO / path
            defined = source.exists() and re.search(
                rf"^(async )?def {name}\(", source.read_text(), re.MULTILINE
            )
            if not defined:
                missing.append(f"{path}::{name}")
    assert not missing, f"docs/SECURITY.md names tests that do not exist: {missing}"


def test_the_readme_points_to_it() -> None:
    readme = (REPO / "README.md").read_text()
    assert "docs/SECURITY.md" in readme
