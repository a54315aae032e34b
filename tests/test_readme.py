"""The README stays short and true: its length, its links (and the docs' links), what it
says the default job prints, and the config groups its `parity` commands use."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from conftest import composed
from pipeline.config import validation

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
CONF = REPO / "conf"
MAX_README_LINES = 200

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def readme() -> str:
    return README.read_text(encoding="utf-8")


def section(text: str, title: str) -> str:
    """The body of the `## title` section (up to the next `## ` heading)."""
    match = re.search(rf"^## {re.escape(title)}[ \t]*\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"README.md has no '## {title}' section"
    return match.group(1)


# (a) length

def test_readme_is_at_most_200_lines():
    lines = readme().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines (at most {MAX_README_LINES})"


# (b) links

def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lowercase, punctuation removed
    (letters, digits, `_`, `-` and spaces stay), spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set:
    seen: dict = {}
    result = set()
    for line in FENCE.sub("", path.read_text(encoding="utf-8")).splitlines():
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def relative_links(path: Path):
    text = INLINE_CODE.sub("", FENCE.sub("", path.read_text(encoding="utf-8")))
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto: ...
            continue
        yield target


def markdown_files():
    return [README, *sorted((REPO / "docs").glob("*.md"))]


def test_relative_links_resolve_to_files_and_headings():
    broken = []
    for source in markdown_files():
        for target in relative_links(source):
            file_part, _, anchor = target.partition("#")
            resolved = (source.parent / file_part).resolve() if file_part else source
            name = f"{source.relative_to(REPO)}: ({target})"
            if not resolved.exists():
                broken.append(f"{name}: no file {file_part}")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{name}: no heading #{anchor} in {resolved.relative_to(REPO)}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_slug_follows_github():
    assert slug("precision=auto") == "precisionauto"
    assert slug("Weight rounding (`weight_rounding.py`)") == "weight-rounding-weight_roundingpy"
    assert slug("Speed: faster and still right") == "speed-faster-and-still-right"
    assert slug("Dynamic shapes") == "dynamic-shapes"


# (c) the default job is what the README says

def config_defaults() -> dict:
    defaults = yaml.safe_load((CONF / "config.yaml").read_text())["defaults"]
    return {k: v for item in defaults if isinstance(item, dict) for k, v in item.items()}


def default_job_description() -> str:
    """The paragraph after the fenced `pip install -e . && parity` block."""
    text = readme()
    match = re.search(r"^```[^\n]*\npip install -e \. && parity\n```\n\n(.*?)(?=\n\n|\n```)", text, re.S | re.M)
    assert match, "README.md lacks the `pip install -e . && parity` block"
    return match.group(1)


@pytest.fixture(scope="module")
def default_job(auto_default_run):
    """The default job (conftest: run once for the session, shared with test_auto.py)."""
    _, result = auto_default_run
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def test_readme_names_the_default_precision_and_target():
    defaults = config_defaults()
    set_up = section(readme(), "Set up")
    assert f"`precision={defaults['precision']}`" in set_up
    named = set(re.findall(r"precision=(\w+)", set_up))
    assert named == {defaults["precision"]}, f"the Set up section names precision={named - {defaults['precision']}}"
    assert f"`{defaults['target']}`" in default_job_description()


def test_readme_lists_what_ci_installs():
    script = (REPO / ".ci" / "run").read_text().replace("\\\n", " ")
    install = re.search(r"apt-get install ([^\n>]*)", script).group(1)
    packages = [word for word in install.split() if not word.startswith("-")]
    assert packages
    set_up = section(readme(), "Set up")
    missing = [p for p in packages if p not in set_up]
    assert not missing, f"README's Set up section misses apt packages .ci/run installs: {missing}"
    test_command = 'pip install -e ".[ncnn,mnn,sweep,test]" && python -m pytest -q -n 2 --dist loadfile'
    assert test_command in script and test_command in set_up


def test_default_job_prints_what_the_readme_describes(default_job):
    stdout = default_job.stdout
    spans = re.findall(r"`([^`\n]+)`", default_job_description())
    assert len(spans) >= 10, spans
    missing = []
    for span in spans:
        # `...` stands for the rest of a line; `<date>` and the like for one path part
        parts = [p.strip() for p in span.split("...") if p.strip()]
        patterns = [re.sub(r"<[^>]+>", r"[^/\\s]+", re.escape(p.rstrip("/"))) for p in parts]
        if not all(re.search(pattern, stdout) for pattern in patterns):
            missing.append(span)
    assert not missing, f"the README says the default job prints {missing}; it printed:\n{stdout}"
    shipped = re.search(r"precision=auto shipped (\w+)", stdout).group(1)
    assert shipped in ("int8", "int8_dynamic", "fp32"), shipped  # what the README says can ship
    assert re.search(rf"bundle: .*digits_cnn-ort_cpu-{shipped}$", stdout, re.M)  # int8_dynamic too


# (d) the README's parity commands use groups and options that exist

def readme_parity_commands():
    commands = []
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", readme(), re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words and words[0] == "parity":
                commands.append(words[1:])
    return commands


def config_groups() -> set:
    groups = {p.name for p in CONF.iterdir() if p.is_dir() and not p.name.startswith("__")}
    top = set(yaml.safe_load((CONF / "config.yaml").read_text())) - {"defaults"}
    return groups | top


def overrides(args):
    return [a for a in args if "=" in a and not a.startswith("-")]


def test_readme_parity_commands_use_existing_groups_and_options():
    commands = readme_parity_commands()
    assert len(commands) >= 5, commands
    groups = config_groups()
    wrong = []
    for args in commands:
        own_config = "--config-dir" in args
        for arg in overrides(args):
            key, value = arg.split("=", 1)
            key = key.lstrip("+~")
            head = re.split(r"[./]", key)[0]
            if head not in groups:
                wrong.append(f"{arg}: no config group or key {head!r} in conf/")
            elif "." not in key and "/" not in key and (CONF / head).is_dir() and not own_config:
                wrong += [f"{arg}: no conf/{head}/{v}.yaml" for v in value.split(",")
                          if not (CONF / head / f"{v}.yaml").exists()]
    assert not wrong, "\n".join(wrong)


def test_readme_parity_commands_compose():
    """Each command's config composes and validates: keys, values and combinations are
    checked before any work. A sweep is checked with its first values."""
    checked = 0
    for args in readme_parity_commands():
        if "--config-dir" in args:  # the user's own folder, not in this repository
            continue
        single = []
        for arg in args:
            if arg in ("-m", "--multirun") or arg.lstrip("+~").startswith("hydra"):
                continue
            key, eq, value = arg.partition("=")
            if eq and "," in value and not value.startswith(("[", "{")):
                arg = f"{key}={value.split(',')[0]}"
            single.append(arg)
        try:
            validation.validate(composed(*single))
        except Exception as err:  # noqa: BLE001 - the command's error, named in the failure
            pytest.fail(f"parity {' '.join(args)}: {type(err).__name__}: {err}")
        checked += 1
    assert checked >= 4
