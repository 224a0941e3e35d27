"""Relative links in the repository's Markdown (README.md, BENCHMARKS.md, docs/, benchmarks/) point at files that
exist and, with a #fragment, at a heading of that file, by GitHub's rule for heading anchors: lower case, characters
other than letters, digits, '_', '-' and spaces dropped, spaces as '-', repeated headings numbered -1, -2, ..."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def markdown_files():
    return [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md")),
            *sorted((ROOT / "benchmarks").glob("*.md"))]


def heading_anchors(text: str) -> set[str]:
    anchors, seen = set(), {}
    for line in text.splitlines():
        heading = re.match(r"^#{1,6}\s+(.*?)\s*$", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def test_the_slug_rule_on_headings_with_code_and_punctuation():
    text = "## Megatron `--transformer-impl coat` against TE (H100)\n# A\n# A\n"
    assert heading_anchors(text) == {"megatron---transformer-impl-coat-against-te-h100", "a", "a-1"}


def test_relative_links_reach_a_file_and_a_heading():
    broken = []
    for source in markdown_files():
        text = source.read_text()
        prose = re.sub(r"`[^`\n]*`", "", re.sub(r"```.*?```", "", text, flags=re.S))  # code is not a link
        for target in LINK.findall(prose):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, fragment = target.partition("#")
            resolved = (source.parent / path) if path else source
            if not resolved.exists():
                broken.append(f"{source.name}: {target} (no such file)")
            elif fragment and resolved.suffix == ".md" and fragment not in heading_anchors(resolved.read_text()):
                broken.append(f"{source.name}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
