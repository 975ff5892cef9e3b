"""No history in the house: the code says why, not when; the repository names no one's machine; the doors stay short.

History (which session measured what, what a number was before) belongs in commit messages, and a path on
the machine that wrote a file means nothing on the next one. Each allowlist below names a string that looks
like history or a machine path but is data, with the reason it has to stay as it is.
"""

from __future__ import annotations

import io
import re
import subprocess
import tokenize
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "semantic_tui", "semantic_cli")

# A date, a session number, a report folder's session tag ("-s31", "report s31", "s44's"), or "an earlier
# session": what a comment or docstring carries when it tells when rather than why.
STAMP = re.compile(
    r"\b20\d\d-\d\d-\d\d\b"
    r"|\bsessions?\s+\d+\b"
    r"|\b(?:reports?|since|until|before|after)\s+s\d{1,3}\b|\bs\d{1,3}'s\b|-s\d{1,3}\b"
    r"|\b(?:earlier|previous|last|past)\s+sessions?\b"
    r"|\b(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]*\.?\s+\d{1,2},?\s+20\d\d\b",
    re.IGNORECASE,
)
# Protocol identifiers that contain a date; each is sent or compared as written.
STAMP_ALLOWED: dict[str, str] = {
    "cache-diagnosis-2026-04-07": "the name of Anthropic's cache-diagnostics beta, as clients send it in "
                                  "anthropic-beta",
}
TEXT_TOKENS = {tokenize.COMMENT, tokenize.STRING} | (
    {tokenize.FSTRING_MIDDLE} if hasattr(tokenize, "FSTRING_MIDDLE") else set())

# An absolute path on some machine: a temp folder, a home folder, macOS's per-user temp root.
PATH_TAIL = r"[^\s\"'`<>()\[\]{},;]*"
MACHINE_PATH = re.compile(rf"(?<![\w.~-])(?:/(?:tmp|root|private/var)/|/(?:home|Users)/[\w.-]+/){PATH_TAIL}")


def rooted(*parts: str) -> str:
    """``/a/b``: the machine paths this file names are built from their parts, so it holds none itself."""
    return "/" + "/".join(parts)


TMP = rooted("tmp", "")
# (file, how the path starts) -> why it stays. A file's every path starting so is allowed.
PATHS_ALLOWED: dict[tuple[str, str], str] = {
    ("tests/model/test_vision_real.py", TMP + "shot.png"):
        "a tool call's argument in a random-weight model's prompt: its greedy reply depends on the exact bytes",
    ("tests/unit/test_api_security.py", rooted("home", "someone", ".ssh", "id_rsa")):
        "a stand-in secret: the tests check that error replies never echo a private file's path",
    ("tests/unit/test_cache_forensics.py", TMP + "aaa"):
        "Claude Code's working-directory line as it writes it (absolute): the test classifies that line",
    ("tests/unit/test_cache_forensics.py", TMP + "bbb"):
        "the same line with another directory: the span that differs between the two prompts",
    **{(f"bench/traces/{name}.jsonl", TMP):
       "recorded client traffic, replayed byte for byte: the client's working directory is part of the "
       "recorded prompts, whose token counts and shared prefixes the benchmarks and model tests compare"
       for name in ("claude_code_bare", "claude_code_continue_runaway", "claude_code_full",
                    "claude_code_haiku_side", "claude_code_tool_turns", "claude_code_write_turns", "codex_exec")},
}

DOOR_LINES = {"README.md": 400, "docs/performance.md": 300}


def tracked(*paths: str) -> list[Path]:
    """The files git tracks under ``paths`` (all of them with none) that exist in the working tree."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    names = subprocess.run(["git", "ls-files", "-z", "--", *paths], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    return [ROOT / name for name in names if name and (ROOT / name).is_file()]


def stamps(source: str) -> list[tuple[int, str]]:
    """(line, stamp) for each session or date stamp in the comments and strings (docstrings included) of
    ``source``; code outside them is not read."""
    found = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in TEXT_TOKENS:
            continue
        text = token.string
        for allowed in STAMP_ALLOWED:
            text = text.replace(allowed, " " * len(allowed))
        found += [(token.start[0] + text[:m.start()].count("\n"), m.group()) for m in STAMP.finditer(text)]
    return found


def machine_paths(relative: str, text: str) -> list[tuple[int, str]]:
    """(line, path) for each absolute machine path in ``text`` that PATHS_ALLOWED does not name for this file."""
    allowed = [start for (name, start) in PATHS_ALLOWED if name == relative]
    return [(text[:m.start()].count("\n") + 1, m.group()) for m in MACHINE_PATH.finditer(text)
            if not any(m.group().startswith(start) for start in allowed)]


def test_code_comments_and_docstrings_carry_no_session_or_date_stamps() -> None:
    found = [f"{path.relative_to(ROOT)}:{line}: {stamp!r}"
             for path in tracked(*PACKAGES) if path.suffix == ".py"
             for line, stamp in stamps(path.read_text(encoding="utf-8"))]
    assert not found, ("a measurement names its tool and machine, not its date or session; history goes in the "
                       "commit message:\n" + "\n".join(found))


def test_the_stamp_check_finds_a_date_or_a_session_and_passes_protocol_names() -> None:
    snippet = '''
def pace(step):
    """Paced since report s31 (2026-12-02-cpu-2core-s31)."""
    limit = 4  # measured 2026-12-07
    # session 47 took it to 8
    return f"{limit} (earlier session)", "cache-diagnosis-2026-04-07", session_id_47
'''
    assert stamps(snippet) == [(3, "report s31"), (3, "2026-12-02"), (3, "-s31"), (4, "2026-12-07"),
                               (5, "session 47"), (6, "earlier session")]
    assert stamps('BETA = "cache-diagnosis-2026-04-07"  # the beta a client opts in with\n') == []


def test_no_tracked_file_names_a_path_on_someones_machine() -> None:
    found = []
    for path in tracked():
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        relative = path.relative_to(ROOT).as_posix()
        found += [f"{relative}:{line}: {hit}" for line, hit in machine_paths(relative, text)]
    assert not found, ("use a path relative to the repository (or tempfile.gettempdir()), or add the string to "
                       f"PATHS_ALLOWED with its reason; {len(found)} found:\n" + "\n".join(found))


def test_the_allowlists_name_only_what_is_there() -> None:
    """An entry whose string left its file goes too, so the lists stay the exceptions that exist."""
    gone = [f"{name}: {start}" for (name, start) in PATHS_ALLOWED
            if not (ROOT / name).is_file() or start not in (ROOT / name).read_text(encoding="utf-8")]
    sources = "".join(path.read_text(encoding="utf-8") for path in tracked(*PACKAGES) if path.suffix == ".py")
    gone += [name for name in STAMP_ALLOWED if name not in sources]
    assert not gone


def test_the_machine_path_check_finds_home_and_temp_folders() -> None:
    home, users, private = rooted("home", "ana", "models", "x"), rooted("Users", "Bo", "y"), rooted("private", "var", "z")
    out, cache = TMP + "out.json", rooted("root", ".cache")
    text = f"see {home} and {users}, {private}, {out}\n{cache}\n"
    assert machine_paths("docs/x.md", text) == [(1, home), (1, users), (1, private), (1, out), (2, cache)]
    assert machine_paths("tests/model/test_vision_real.py", '{"file_path": "%sshot.png"}' % TMP) == []
    assert machine_paths("docs/x.md", "bench/reports/run" + TMP + "x ~/models " + rooted("home", "<user>")) == []


@pytest.mark.parametrize("name", sorted(DOOR_LINES))
def test_the_doors_stay_short(name: str) -> None:
    """README.md is a door and docs/performance.md a summary: the details live in the docs they link to."""
    lines = len((ROOT / name).read_text(encoding="utf-8").splitlines())
    assert lines <= DOOR_LINES[name], f"{name} has {lines} lines, at most {DOOR_LINES[name]}"
