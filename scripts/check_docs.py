#!/usr/bin/env python3
"""Checks the documentation's links: every page of docs/ is linked from docs/README.md (the index),
and every relative link of README.md, docs/*.md and bench/**/*.md points to a file or folder that
exists (and, for `page.md#anchor`, to a heading of that page). With --paths it also checks that the
repository paths the pages name in code spans, code blocks and indented commands
(`src/torch/core/version.cc`, `src/comm/wire.{h,cc}`, `bench/compare/`; a program by its source,
`bench/micro/allreduce_latency`) exist, except in bench/results/, whose pages quote paths as they
were when the runs were made.

    scripts/check_docs.py [--root REPO] [--paths]

Standard library only. Prints one line per problem and a summary; exit 0 when there is none, 1
otherwise.
"""

import argparse
import glob
import re
import sys
from pathlib import Path

LINK = re.compile(r"(?<!!)\[([^\]]*)\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
# Top-level folders of the repository whose paths the pages name.
TOP = ("src/", "include/", "tests/", "bench/", "scripts/", "tools/", "examples/", "python/",
       "cmake/", "docs/", ".ci/")


def slug(heading):
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"`", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page):
    found, seen = set(), {}
    in_code = False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        base = slug(line.lstrip("#"))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def lines(page):
    """The page's lines with their numbers, and whether each is inside a fenced code block."""
    in_code = False
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_code = not in_code
            continue
        yield number, line, in_code


def prose(page):
    """The page's lines outside fenced code blocks, with their numbers."""
    for number, line, in_code in lines(page):
        if not in_code:
            yield number, line


def expand(path):
    """`a/b.{h,cc}` -> [a/b.h, a/b.cc] (one brace group)."""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [path[:m.start()] + part + path[m.end():] for part in m.group(1).split(",")]


def path_exists(root, path):
    path = path.rstrip(".,;:)")
    for one in expand(path):
        if any(c in one for c in "*?["):
            if not glob.glob(str(root / one)):
                return False
        elif not any((root / (one + ext)).exists() for ext in ("", ".cc", ".c")):
            return False
    return True


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default=Path(__file__).resolve().parent.parent, type=Path)
    parser.add_argument("--paths", action="store_true",
                        help="also check the repository paths the pages name")
    args = parser.parse_args()
    root = args.root.resolve()
    docs = root / "docs"
    pages = [root / "README.md", *sorted(docs.glob("*.md")),
             *sorted((root / "bench").rglob("*.md"))]
    problems = []
    links = 0

    # The index links every page of docs/.
    index = docs / "README.md"
    linked = set()
    for _, line in prose(index):
        for m in LINK.finditer(line):
            target = (m.group(2) or m.group(3)).split("#")[0]
            if target and not re.match(r"[a-z]+:", target):
                linked.add((index.parent / target).resolve())
    for page in sorted(docs.glob("*.md")):
        if page != index and page.resolve() not in linked:
            problems.append(f"docs/README.md: does not link {page.relative_to(root)}")

    anchor_cache = {}
    for page in pages:
        rel = page.relative_to(root)
        for number, line, in_code in lines(page):
            if args.paths and "results" not in rel.parts:
                # Code spans in prose; every word of a code block or an indented command.
                if in_code or line.startswith("    "):
                    words = line.split()
                else:
                    words = [w for m in CODE_SPAN.finditer(line) for w in m.group(1).split()]
                for word in words:
                    word = word.lstrip("'\"(`").rstrip("'\"(),;:.`")
                    if not word.startswith(TOP) or "<" in word or "$" in word:
                        continue
                    if not path_exists(root, word):
                        problems.append(f"{rel}:{number}: names a path that does not exist: "
                                        f"{word}")
            if in_code:
                continue
            for m in LINK.finditer(line):
                target = m.group(2) or m.group(3)
                if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                    continue
                links += 1
                file_part, _, anchor = target.partition("#")
                dest = (page.parent / file_part).resolve() if file_part else page
                if not dest.exists():
                    problems.append(f"{rel}:{number}: link to a missing file: {target}")
                    continue
                if anchor and dest.suffix == ".md":
                    if dest not in anchor_cache:
                        anchor_cache[dest] = anchors(dest)
                    if anchor not in anchor_cache[dest]:
                        problems.append(f"{rel}:{number}: no heading #{anchor} in "
                                        f"{dest.relative_to(root)}")

    for problem in problems:
        print(problem)
    print(f"check_docs: {len(pages)} pages, {links} relative links, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
