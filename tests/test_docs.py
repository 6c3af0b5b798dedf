"""The documentation speaks of the product in the present tense (docs/testing.md): a short README,
no page that dates itself by the order of the work, no page past its size."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
# Phrases that date a passage by when in the work it was written, not by a calendar date.
DIARY = re.compile(
    r"\b(?:(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
    r"[a-z]+teenth|twentieth|twenty-[a-z]+|thirtieth|last|next|previous|this|that|earlier|later) session\b"
    r"|\bthe day before\b|\blater that day\b|\bon a later day\b|\byesterday\b|\bearlier today\b"
    r"|\bthe speed issue's notes\b|\bissue \d+\b)",
    re.IGNORECASE)


def test_the_readme_is_short_with_no_long_line() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.encode()) <= 15 * 1024
    long_lines = [number for number, line in enumerate(readme.splitlines(), 1) if len(line) > 300]
    assert not long_lines, f"README.md lines over 300 characters: {long_lines}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_page_dates_itself_by_the_work(page: Path) -> None:
    found = [f"{page.name}:{number}: {match.group(0)!r}"
             for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
             for match in DIARY.finditer(line)]
    assert not found, "\n".join(found)


def test_no_page_is_past_40_kb() -> None:
    sizes = {page.name: len(page.read_bytes()) for page in (ROOT / "docs").glob("*.md")}
    assert not {name: size for name, size in sizes.items() if size > 40 * 1024}


def test_the_benchmark_page_shows_the_committed_reports() -> None:
    """docs/benchmarks.md's latest figures are made from docs/bench-results/*.json, never typed."""
    from cdc_apply.bench.report import PAGE, committed_reports, page_section

    page = PAGE.read_text(encoding="utf-8")
    reports = committed_reports()
    assert reports, "no committed benchmark report"
    assert page == page_section(page, reports), "run: python -m cdc_apply.bench.report"
    for report in reports:
        assert {"bench", "arguments", "figures", "goals", "machine", "date", "commit"} <= set(report)
