"""Theme files and UI preferences."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from textual.app import App
from textual.theme import BUILTIN_THEMES, Theme

from semantic_tui.preferences import ChatLayout, Preferences, load_preferences, save_preferences
from themes import DEFAULT_THEME, TERMINAL_THEMES, THEME_CHOICES, ThemeFileError, load_theme_file, load_themes, register_themes

VALID = """
name = "test-theme"
dark = false
primary = "#112233"
background = "#ffffff"
"""


def write(tmp_path: Path, text: str, name: str = "bad.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# -- themes -----------------------------------------------------------------------------------
def test_shipped_themes_parse():
    themes = {t.name: t for t in load_themes()}
    assert set(themes) == {"semantic-dark", "semantic-light"}
    assert themes["semantic-dark"].dark and not themes["semantic-light"].dark
    for theme in themes.values():
        assert isinstance(theme, Theme)
        assert all(getattr(theme, key) for key in ("primary", "secondary", "accent", "foreground", "background",
                                                   "surface", "panel", "success", "warning", "error"))
    assert THEME_CHOICES[:2] == ("semantic-dark", "semantic-light")
    assert TERMINAL_THEMES and set(TERMINAL_THEMES) <= set(BUILTIN_THEMES)
    assert all(BUILTIN_THEMES[name].ansi for name in TERMINAL_THEMES)  # they follow the terminal palette
    assert DEFAULT_THEME in themes


async def test_app_registers_themes_and_switches_at_run_time():
    app = App()
    async with app.run_test(size=(40, 10)) as pilot:
        names = register_themes(app)
        assert names == ["semantic-dark", "semantic-light"]
        for name in THEME_CHOICES:
            app.theme = name
            await pilot.pause()
            assert app.theme == name and app.current_theme.name == name
        app.theme = "semantic-light"
        await pilot.pause()
        assert app.current_theme.dark is False
        assert app.get_css_variables()["background"].lower() == "#f7f8fa"


def test_a_valid_file_from_another_directory(tmp_path):
    write(tmp_path, VALID, "test.toml")
    write(tmp_path, "not a theme", "notes.txt")
    [theme] = load_themes(tmp_path)
    assert (theme.name, theme.primary, theme.dark) == ("test-theme", "#112233", False)


@pytest.mark.parametrize(("text", "key"), [
    (VALID + 'primry = "#000000"\n', "primry"),  # a typo is an unknown key, not a silently ignored colour
    (VALID.replace('primary = "#112233"', 'primary = "not-a-colour"'), "primary"),
    (VALID + 'surface = 12\n', "surface"),
    (VALID.replace("dark = false", 'dark = "no"'), "dark"),
    (VALID.replace("dark = false\n", ""), "dark"),
    (VALID.replace('name = "test-theme"', 'name = ""'), "name"),
    (VALID + "text_alpha = 2.0\n", "text_alpha"),
    (VALID + "[variables]\nborder = 3\n", "variables.border"),
])
def test_malformed_theme_names_file_and_key(tmp_path, text, key):
    path = write(tmp_path, text)
    with pytest.raises(ThemeFileError) as caught:
        load_theme_file(path)
    assert caught.value.key == key
    assert str(path) in str(caught.value) and repr(key) in str(caught.value)


def test_broken_toml_names_the_file(tmp_path):
    path = write(tmp_path, 'name = "x\nprimary = ')
    with pytest.raises(ThemeFileError, match="not valid TOML") as caught:
        load_themes(tmp_path)
    assert str(path) in str(caught.value)


def test_two_files_with_one_name_is_an_error(tmp_path):
    write(tmp_path, VALID, "a.toml")
    second = write(tmp_path, VALID, "b.toml")
    with pytest.raises(ThemeFileError, match="already defined") as caught:
        load_themes(tmp_path)
    assert caught.value.source == str(second)


# -- preferences ------------------------------------------------------------------------------
def test_missing_file_gives_defaults_quietly(tmp_path):
    warnings: list[str] = []
    assert load_preferences(tmp_path / "none.json", warnings.append) == Preferences()
    assert warnings == []


def test_round_trip(tmp_path):
    path = tmp_path / "nested" / "workbench.json"
    prefs = Preferences("semantic-light", {"app.quit": "ctrl+q", "agents.open": "o"}, ChatLayout.SPLIT)
    assert save_preferences(prefs, path) == path
    assert load_preferences(path) == prefs
    assert json.loads(path.read_text())["chat_layout"] == "split"
    assert [p.name for p in path.parent.iterdir()] == ["workbench.json"]  # no temp file left behind


def test_loaded_preferences_save_back_to_their_file(tmp_path):
    path = tmp_path / "workbench.json"
    prefs = load_preferences(path)
    prefs.theme = "semantic-light"
    assert prefs.save() == path
    assert load_preferences(path).theme == "semantic-light"


def test_save_replaces_atomically(tmp_path, monkeypatch):
    path = tmp_path / "workbench.json"
    save_preferences(Preferences("semantic-dark"), path)

    def crash(*args):
        raise OSError("disk full")

    monkeypatch.setattr("semantic_tui.preferences.os.replace", crash)
    with pytest.raises(OSError):
        save_preferences(Preferences("semantic-light"), path)
    assert load_preferences(path).theme == "semantic-dark"
    assert [p.name for p in tmp_path.iterdir()] == ["workbench.json"]


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", "\xff\xfe"])
def test_corrupt_file_gives_defaults_and_a_warning(tmp_path, content):
    path = tmp_path / "workbench.json"
    path.write_bytes(content.encode("latin-1"))
    warnings: list[str] = []
    assert load_preferences(path, warnings.append) == Preferences()
    assert len(warnings) == 1 and str(path) in warnings[0]


def test_bad_fields_fall_back_one_by_one(tmp_path):
    path = tmp_path / "workbench.json"
    path.write_text(json.dumps({"theme": 7, "keymap": {"app.quit": "ctrl+q", "x": 3}, "chat_layout": "grid"}))
    warnings: list[str] = []
    prefs = load_preferences(path, warnings.append)
    assert prefs == Preferences(DEFAULT_THEME, {"app.quit": "ctrl+q"}, ChatLayout.TABS)
    assert len(warnings) == 3


def test_warnings_go_to_the_log_by_default(tmp_path, caplog):
    path = tmp_path / "workbench.json"
    path.write_text("{oops")
    with caplog.at_level("WARNING", logger="semantic.tui.preferences"):
        load_preferences(path)
    assert "unreadable preferences file" in caplog.text


def test_default_path_is_in_the_user_config_dir(monkeypatch, tmp_path):
    from semantic_tui import preferences

    monkeypatch.setattr(preferences.platformdirs, "user_config_dir", lambda app: str(tmp_path / app))
    assert preferences.default_preferences_path() == tmp_path / "semantic" / "workbench.json"
