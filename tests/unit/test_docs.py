"""The README and docs/ name only what exists.

Every relative link reaches a file (an ``#anchor`` a heading there, by GitHub's slug
rules); every ``make`` target, ``statecache`` subcommand and its ``--flags``,
``python -m`` module and repository path that their code names exists; every config key
they name is in ``statecache/config/sections.py``'s schema, and every TOML config they show
loads; docs/configuration.md lists every key with its default; the README stays short
enough to read in five minutes. No model, no server: a second.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import io
import re
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from statecache import config as config_mod
from statecache.config import ConfigError, RemoteConfig, load_config
from statecache.config import load as config_load

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 250
SECTIONS = dict(config_load._SECTIONS)
# file names that look like "section.key" (engine.py, model.gguf): not keys
_EXTENSIONS = {"py", "gguf", "md", "toml", "json", "jinja", "sh", "txt", "png", "html"}
_REPO_DIRS = ("statecache", "proxy", "bench", "tools", "tests", "docs", "configs", "scripts",
              "vendor", ".ci")
_SHELL = {"", "sh", "bash", "shell", "console"}


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@dataclass(slots=True, frozen=True)
class Page:
    """A Markdown file split the way a reader's renderer does: prose, fenced blocks,
    inline code spans and headings."""

    path: Path
    prose: str  # fenced blocks blanked, inline code spans kept
    blocks: tuple[tuple[str, str], ...]  # (language, body)
    headings: tuple[str, ...]

    @classmethod
    def read(cls, path: Path) -> Page:
        prose: list[str] = []
        blocks: list[tuple[str, str]] = []
        headings: list[str] = []
        fence: str | None = None
        lang, body = "", list[str]()
        for line in path.read_text().splitlines():
            stripped = line.strip()
            if fence is None and (stripped.startswith("```") or stripped.startswith("~~~")):
                fence, lang, body = stripped[:3], stripped[3:].strip().split(" ")[0], []
                prose.append("")
            elif fence is not None and stripped.startswith(fence):
                blocks.append((lang, "\n".join(body)))
                fence = None
                prose.append("")
            elif fence is not None:
                body.append(line)
                prose.append("")
            else:
                prose.append(line)
                m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
                if m:
                    headings.append(m.group(1))
        return cls(path, "\n".join(prose), tuple(blocks), tuple(headings))

    def spans(self) -> list[str]:
        """Inline code spans (they may wrap across lines), whitespace made single."""
        return [" ".join(m.group(2).split())
                for m in re.finditer(r"(`+)([^`]+?)\1", self.prose)]

    def code(self) -> Iterator[str]:
        """Every piece of code: inline spans, then each line of each fenced block."""
        yield from self.spans()
        for _lang, body in self.blocks:
            yield from body.splitlines()

    def shell(self) -> Iterator[str]:
        """Code that can hold a command: inline spans and shell-like blocks' lines."""
        yield from self.spans()
        for lang, body in self.blocks:
            if lang in _SHELL:
                yield from (re.split(r"(?:^|\s)#", line)[0] for line in body.splitlines())


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text lowercased, punctuation but
    hyphens and underscores dropped, spaces made hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Page) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for h in page.headings:
        s = slug(h)
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


# -- the checks: each returns the problems it found --------------------------------------


def link_problems(page: Page) -> list[str]:
    prose = re.sub(r"(`+)[^`]+?\1", "code", page.prose)  # a link inside code is not one
    out = []
    for m in re.finditer(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", prose):
        target = m.group(1)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (page.path.parent / file_part).resolve() if file_part else page.path
        where = f"{_name(page.path)}: ({target})"
        if not dest.exists():
            out.append(f"{where}: no file {file_part}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(Page.read(dest)):
            out.append(f"{where}: no heading #{anchor} in {dest.name}")
    return out


def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {m.group(1) for m in re.finditer(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", text, re.M)}


def make_problems(page: Page, targets: set[str]) -> list[str]:
    out = []
    for code in page.shell():
        for m in re.finditer(r"(?:^|(?<=[\s;&(|]))make\s+(?:[A-Z_]+=\S+\s+)*([a-z][\w-]*)", code):
            if m.group(1) not in targets:
                out.append(f"{_name(page.path)}: `make {m.group(1)}`: "
                           "no such Makefile target")
    return out


def cli_help(sub: str) -> str | None:
    """The subcommand's --help, from the `statecache` command's own parser; None where
    the parser does not know it."""
    from proxy.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([sub, "--help"])
    return out.getvalue() if code == 0 else None


_CLI = re.compile(r"(?:^|(?<=[\s;&(|]))(?:\.venv/bin/)?statecache\s+([a-z][\w-]*)([^#|;&]*)")


def cli_problems(page: Page, helps: dict[str, str | None]) -> list[str]:
    out = []
    for code in page.shell():
        for m in _CLI.finditer(code):
            sub, rest = m.group(1), m.group(2)
            if sub not in helps:
                helps[sub] = cli_help(sub)
            text = helps[sub]
            name = f"{_name(page.path)}: `statecache {sub}`"
            if text is None:
                out.append(f"{name}: no such subcommand")
                continue
            for flag in re.findall(r"(?<![\w-])--[a-z][\w-]*", rest):
                if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text):
                    out.append(f"{name} {flag}: no such option")
    return out


def module_file(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for p in (base.with_suffix(".py"), base / "__main__.py"):
        if p.is_file():
            return p
    return None


def module_problems(page: Page) -> list[str]:
    """Each `python -m M` names a module (the repository's, else an installed tool's),
    and each --flag after it is a string the repository's module spells out."""
    out = []
    for code in page.shell():
        for m in re.finditer(r"python3?\s+-m\s+([A-Za-z_][\w.]*)([^`]*)", code):
            module = m.group(1).rstrip(".")
            top = module.split(".")[0]
            name = f"{_name(page.path)}: `python -m {module}`"
            if not ((ROOT / top).is_dir() or (ROOT / f"{top}.py").is_file()):
                if importlib.util.find_spec(top) is None:
                    out.append(f"{name}: no such module")
                continue
            f = module_file(module)
            if f is None:
                out.append(f"{name}: no such module in the repository")
                continue
            source = f.read_text()
            for flag in re.findall(r"(?<![\w-])--[a-z][\w-]*", m.group(2)):
                if f'"{flag}"' not in source and f"'{flag}'" not in source:
                    out.append(f"{name} {flag}: no such option in {_name(f)}")
    return out


_KEY = re.compile(r"(?<![\w./-])(" + "|".join(SECTIONS) + r")\.([a-z_]+)(?:\.([a-z_]+))?")


def named_keys(page: Page) -> set[str]:
    keys = set()
    for code in page.code():
        for m in _KEY.finditer(code):
            if m.group(2) in _EXTENSIONS:
                continue
            keys.add(".".join(g for g in m.groups() if g))
    return keys


def key_exists(key: str) -> bool:
    section, name, *sub = key.split(".")
    fields = {f.name for f in dataclasses.fields(SECTIONS[section])}
    if key in config_load._RETIRED:
        return True
    if name not in fields:
        return False
    if section == "cache" and name == "remote" and sub:
        return sub[0] in {f.name for f in dataclasses.fields(RemoteConfig)}
    return not sub


def config_block_problems(page: Page, tmp: Path) -> list[str]:
    """Each TOML block made only of statecache's sections must load as a config."""
    out = []
    for i, (lang, body) in enumerate(page.blocks):
        if lang != "toml":
            continue
        data = tomllib.loads(body)
        if not data or not set(data) <= set(SECTIONS):
            continue  # another program's config (Codex's)
        f = tmp / f"block{i}.toml"
        f.write_text(body)
        try:
            load_config(f)
        except ConfigError as e:
            out.append(f"{_name(page.path)}: a TOML block does not load: {e}")
    return out


_PATH = re.compile(r"(?:" + "|".join(map(re.escape, _REPO_DIRS)) + r")/[\w./-]+")


def path_problems(page: Page) -> list[str]:
    out = []
    for code in page.shell():
        for token in code.split():
            token = token.strip("\"'(),;:")
            if _PATH.fullmatch(token) and not (ROOT / token).exists():
                out.append(f"{_name(page.path)}: {token}: no such file")
    return out


_POINTER = re.compile(r"(README(?:\.md)?|docs/[\w-]+\.md),?\s+\(?\"([^\"]+)\"")
_SOURCES = ("statecache", "proxy", "bench", "tools", "tests", "scripts", "configs", "docs")


def pointer_problems(path: Path) -> list[str]:
    """Where a file points at a page's section (`docs/cache.md, "Why did it miss?"`, the
    quote perhaps wrapped over comment lines), that page has that heading; a quote
    ending in "..." names a heading's start."""
    text = re.sub(r"\n[ \t]*#*[ \t]*", " ", path.read_text(errors="replace"))
    out = []
    for m in _POINTER.finditer(text):
        page, quoted = m.group(1), m.group(2).strip()
        dest = ROOT / ("README.md" if page.startswith("README") else page)
        where = f"{_name(path)}: {page}, \"{quoted}\""
        if not dest.is_file():
            out.append(f"{where}: no such page")
            continue
        found = anchors(Page.read(dest))
        want = slug(quoted.removesuffix("..."))
        if not (want in found if not quoted.endswith("...")
                else any(a.startswith(want) for a in found)):
            out.append(f"{where}: no such heading")
    return out


# -- the tests ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def all_pages() -> list[Page]:
    return [Page.read(p) for p in pages()]


def test_readme_reads_in_five_minutes() -> None:
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; move detail to docs/"


def test_links_reach_files_and_headings(all_pages: list[Page]) -> None:
    problems = [p for page in all_pages for p in link_problems(page)]
    assert not problems, "\n".join(problems)


def test_make_targets_exist(all_pages: list[Page]) -> None:
    targets = make_targets()
    assert {"run", "test", "check"} <= targets
    problems = [p for page in all_pages for p in make_problems(page, targets)]
    assert not problems, "\n".join(problems)


def test_statecache_subcommands_and_flags_exist(all_pages: list[Page]) -> None:
    helps: dict[str, str | None] = {}
    problems = [p for page in all_pages for p in cli_problems(page, helps)]
    assert not problems, "\n".join(problems)
    assert helps.get("inspect"), "the docs name `statecache inspect`; the scan missed it"


def test_python_modules_exist(all_pages: list[Page]) -> None:
    problems = [p for page in all_pages for p in module_problems(page)]
    assert not problems, "\n".join(problems)


def test_repository_paths_exist(all_pages: list[Page]) -> None:
    problems = [p for page in all_pages for p in path_problems(page)]
    assert not problems, "\n".join(problems)


def test_pointers_in_the_code_name_headings() -> None:
    files = [ROOT / "README.md", ROOT / "Makefile"] + [
        f for d in _SOURCES for f in sorted((ROOT / d).rglob("*"))
        if f.is_file() and f.suffix in (".py", ".sh", ".toml", ".md", ".json")
        and f != Path(__file__).resolve()]  # its own broken examples are meant
    problems = [p for f in files for p in pointer_problems(f)]
    assert not problems, "\n".join(problems)


def test_config_keys_exist(all_pages: list[Page]) -> None:
    named = {(_name(page.path), k) for page in all_pages for k in named_keys(page)}
    assert len(named) > 50, "the scan found almost no config keys: is it broken?"
    problems = [f"{where}: {key}: not in statecache/config/sections.py"
                for where, key in sorted(named) if not key_exists(key)]
    assert not problems, "\n".join(problems)


def test_config_blocks_load(all_pages: list[Page], tmp_path: Path) -> None:
    problems = [p for page in all_pages for p in config_block_problems(page, tmp_path)]
    assert not problems, "\n".join(problems)


def schema_keys() -> set[str]:
    keys = set()
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            if f.name == "remote":
                keys |= {f"cache.remote.{r.name}" for r in dataclasses.fields(RemoteConfig)}
            else:
                keys.add(f"{section}.{f.name}")
    return keys


def reference_rows() -> dict[str, str]:
    """docs/configuration.md's table rows: key -> the default as a TOML literal."""
    text = (ROOT / "docs" / "configuration.md").read_text()
    return {m.group(1): m.group(2)
            for m in re.finditer(r"^\| `([a-z_.]+)` \| `([^`]*)` \|", text, re.M)}


def test_configuration_reference_has_every_key_and_its_default() -> None:
    rows = reference_rows()
    assert set(rows) == schema_keys(), (
        f"missing from docs/configuration.md: {sorted(schema_keys() - set(rows))}; "
        f"not in the schema: {sorted(set(rows) - schema_keys())}")
    overrides = {k: tomllib.loads(f"v = {lit}")["v"] for k, lit in rows.items()}
    documented, defaults = load_config(None, overrides), load_config(None)
    wrong = [k for k in rows if _value(documented, k) != _value(defaults, k)]
    assert not wrong, "\n".join(f"{k}: documented {rows[k]}, default {_value(defaults, k)!r}"
                                for k in wrong)


def _value(cfg: config_mod.Config, key: str) -> object:
    obj: object = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


# -- the checks can fail -----------------------------------------------------------------


def test_checks_catch_what_is_broken(tmp_path: Path) -> None:
    """A page with one of each mistake: every check reports it, and only it."""
    (tmp_path / "other.md").write_text("# Other page\n\n## A `code` heading: yes\n")
    page_path = tmp_path / "page.md"
    page_path.write_text("\n".join([
        "# Title",
        "[ok](other.md#a-code-heading-yes) [self](#title) [web](https://x.y/z)",
        "[gone](missing.md) [bad anchor](other.md#nope)",
        "Run `make tset` or `make check` or `statecache inspekt` or",
        "`statecache verify --jsn` or `statecache inspect --misses`;",
        "`python -m bench.nothing`; `python -m bench.codec --tokens 9 --tokenz 9`;",
        "`model.n_ctx` and `server.lane`; `tools/nothing.py` and `tools/agents.py`.",
        "```toml", "[server]", "lane = 4", "```",
        "```toml", "[server]", "lanes = 4", "```", ""]))
    page = Page.read(page_path)
    assert [p.rsplit(": ", 1)[-1] for p in link_problems(page)] == [
        "no file missing.md", "no heading #nope in other.md"]
    assert [p.split("`")[1] for p in make_problems(page, make_targets())] == ["make tset"]
    assert [p.rsplit(": ", 1)[-1] for p in cli_problems(page, {})] == [
        "no such subcommand", "no such option"]
    assert [p.rsplit(": ", 1)[-1] for p in module_problems(page)] == [
        "no such module in the repository", "no such option in bench/codec.py"]
    assert [p.rsplit(": ", 2)[-2] for p in path_problems(page)] == ["tools/nothing.py"]
    assert sorted(k for k in named_keys(page) if not key_exists(k)) == ["server.lane"]
    problems = config_block_problems(page, tmp_path)
    assert len(problems) == 1 and "unknown key server.lane" in problems[0]
    code = tmp_path / "code.py"
    code.write_text('# (docs/cache.md, "Why did it miss?"; docs/cache.md, "Why did it\n'
                    '# fail?"; docs/cash.md, "Why"; README, "Two commands"; README, "Two...")\n')
    assert [p.rsplit(": ", 1)[-1] for p in pointer_problems(code)] == [
        "no such heading", "no such page"]


def test_slugs_follow_github() -> None:
    assert slug("hybrid-0.8B") == "hybrid-08b"
    assert slug("Why did it miss?") == "why-did-it-miss"
    assert slug("`[cache.remote]`: the shared tier") == "cacheremote-the-shared-tier"
    assert slug("A long cold prompt's checkpoints") == "a-long-cold-prompts-checkpoints"
    page = Page(Path("x.md"), "", (), ("Follow-up turns", "Variants", "Follow-up turns"))
    assert anchors(page) == {"follow-up-turns", "variants", "follow-up-turns-1"}
