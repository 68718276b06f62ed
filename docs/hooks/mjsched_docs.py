"""mkdocs hook (``hooks:`` in mkdocs.yml): one copy of every text, links that work both on GitHub and in
the site, and a CLI reference generated from the parser.

* Repository files outside ``docs/`` that belong in the manual (README.md as the home page, CHANGELOG.md,
  benchmarks/README.md with its results and plots) are added to the site as pages; nothing is copied.
* Relative links are written for GitHub: relative to the file's place in the repository. In the site each
  one is rewritten to where its target landed, or to the file on ``repo_url`` when the target is a
  repository file that is not part of the site (LICENSE, a plugin module). A link whose target does not
  exist is left as it is, so ``mkdocs build --strict`` reports it: links cannot rot.
* ``reference/cli.md`` is generated from ``mjsched_isolated.cli.parser.build_parser()``, so the
  reference is the parser's own help and cannot drift from it.
* Docstrings' reST roles (``:class:`Client```) are rendered as plain code.
"""

from __future__ import annotations

import argparse
import importlib
import os
import posixpath
import re
from collections.abc import Iterator
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

REPO = Path(__file__).resolve().parents[2]
DOCS = "docs/"
HELP_COLUMNS = "100"

# Repository path -> path in the site, for the files outside docs/ that the manual includes.
INCLUDED = {
    "README.md": "index.md",
    "CHANGELOG.md": "changelog.md",
    "benchmarks/README.md": "benchmarks/README.md",
    "benchmarks/results/REPORT.md": "benchmarks/results/REPORT.md",
    **{p.relative_to(REPO).as_posix(): p.relative_to(REPO).as_posix()
       for p in sorted(REPO.glob("benchmarks/results/*.png"))},
}
ORIGIN = {site: repo for repo, site in INCLUDED.items()}

ROLE = re.compile(r":(?:class|func|meth|attr|exc|mod|data|obj):(?=<code>)")
LINK = re.compile(r"(!?\[[^\]\n]*\]\()([^)\s]+)(\))")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")

def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Add the included repository files and the generated CLI reference."""
    for repo_path, site_path in INCLUDED.items():
        files.append(File.generated(config, site_path, abs_src_path=str(REPO / repo_path)))
    files.append(File.generated(config, "reference/cli.md", content=cli_reference()))
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    """Rewrite the page's relative links (outside fenced code) from repository paths to site paths."""
    src_uri = page.file.src_uri
    origin = ORIGIN.get(src_uri, DOCS + src_uri)
    lines = []
    fenced = False
    for line in markdown.splitlines(keepends=True):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced:
            line = LINK.sub(lambda m: m[1] + site_link(m[2], origin, src_uri, config.repo_url) + m[3], line)
        lines.append(line)
    return "".join(lines)


def on_page_content(html: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    """Drop the reST roles (``:class:`X```) that docstrings use: the rendered page shows the code alone."""
    return ROLE.sub("", html)


def site_link(target: str, origin: str, src_uri: str, repo_url: str | None) -> str:
    """``target``, written relative to repository file ``origin``, as a link from site page ``src_uri``."""
    if SCHEME.match(target) or target.startswith(("#", "/")):
        return target
    path, sep, anchor = target.partition("#")
    repo_path = posixpath.normpath(posixpath.join(posixpath.dirname(origin), path))
    if repo_path.startswith(DOCS):
        site_path = repo_path[len(DOCS):]
    elif repo_path in INCLUDED:
        site_path = INCLUDED[repo_path]
    elif repo_url and not repo_path.startswith("..") and (REPO / repo_path).exists():
        kind = "tree" if (REPO / repo_path).is_dir() else "blob"
        return f"{repo_url.rstrip('/')}/{kind}/main/{repo_path}{sep}{anchor}"
    else:
        return target  # a missing file: left for the strict build to report
    return posixpath.relpath(site_path, posixpath.dirname(src_uri) or ".") + sep + anchor


def build_parser() -> argparse.ArgumentParser:
    """The CLI's parser, from ``mjsched_isolated.cli.parser``."""
    module = importlib.import_module("mjsched_isolated.cli.parser")
    built: argparse.ArgumentParser = module.build_parser()
    return built


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> Iterator[tuple[str, ...]]:
    """``path`` and the paths of every subcommand below it, depth first, in the parser's order."""
    yield path
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            seen: set[int] = set()
            for name, sub in action.choices.items():
                if id(sub) not in seen:  # an alias names the same parser again
                    seen.add(id(sub))
                    yield from commands(sub, (*path, name))


def subparser(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> argparse.ArgumentParser:
    """The parser of subcommand ``path`` (after the program name)."""
    for name in path:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    return parser


def cli_reference() -> str:
    """The CLI reference page: every command's ``--help``, generated at 100 columns."""
    parser = build_parser()
    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_COLUMNS
    try:
        sections = []
        for path in commands(parser, ()):
            text = subparser(parser, path).format_help().rstrip()
            title = " ".join(("mjsched", *path))
            sections.append(f"## {title}\n\n```text\n{text}\n```\n")
    finally:
        if saved is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = saved
    intro = (
        "# CLI reference\n\n"
        "Every command's `--help`, generated from the parser when the manual is built, so it matches the\n"
        "installed version. `python -m mjsched_isolated` is the same program as `mjsched`. What the commands\n"
        "do in practice, with examples, is in [Managing jobs](../operating/jobs.md).\n\n"
    )
    return intro + "\n".join(sections)
