"""Guards for console/tui/compat/ and console/fleet/compat.py: each private name of Textual and asyncssh that gpudeck
uses is still there, with the shape the compat module expects. When one of these fails, the library moved the name:
the compat module's fallback keeps the console working (slower, or without the fix); update the module and its row in
console/tui/compat/README.md."""

from __future__ import annotations

import importlib
import inspect

import asyncssh
import pytest
from rich.terminal_theme import TerminalTheme
from textual.message_pump import MessagePump
from textual.widgets import DataTable, Footer, Header

from gpudeck.console.fleet import compat as fleet_compat
from gpudeck.console.tui.compat.ansi_theme import light_ansi
from gpudeck.console.tui.compat.data_table import FastDataTable

# DataTable's private names compat/data_table.py reads or writes (set in DataTable.__init__ or defined on the class)
DATA_TABLE_FIELDS = [
    "_data",
    "_row_locations",
    "_column_locations",
    "_new_rows",
    "_require_update_dimensions",
    "_update_count",
    "_ordered_row_cache",
    "_offset_cache",
    "_cell_render_cache",
    "_row_render_cache",
    "_row_renderable_cache",
    "_line_cache",
    "_show_hover_cursor",
    "_pseudo_class_state",
    "_labelled_row_exists",
    "_row_label_column_width",
]
# DataTable's private methods it calls or overrides, with the parameters it passes
DATA_TABLE_METHODS = {
    "_clear_caches": [],
    "_update_dimensions": ["new_rows"],
    "_render_cell": ["row_index", "column_index", "base_style", "width", "cursor", "hover"],
    "_render_line_in_row": ["row_key", "line_no", "base_style", "cursor_location", "hover_location"],
    "_get_row_style": ["row_index", "base_style"],
    "_get_row_renderables": ["row_index"],
    "_get_styles_to_render_cell": [
        "is_header_cell",
        "is_row_label_cell",
        "is_fixed_style_cell",
        "hover",
        "cursor",
        "show_cursor",
        "show_hover_cursor",
        "has_css_foreground_priority",
        "has_css_background_priority",
    ],
    "_render_line": ["y", "x1", "x2", "base_style"],
}


@pytest.mark.parametrize("name", DATA_TABLE_FIELDS)
def test_data_table_still_has_each_private_field_compat_uses(name: str) -> None:
    table = DataTable()
    assert hasattr(table, name), f"DataTable no longer has {name}: console/tui/compat/data_table.py falls back; update it"


@pytest.mark.parametrize("name", sorted(DATA_TABLE_METHODS))
def test_data_table_still_has_each_private_method_with_the_parameters_compat_passes(name: str) -> None:
    method = getattr(DataTable, name, None)
    assert method is not None, f"DataTable.{name} is gone: console/tui/compat/data_table.py falls back; update it"
    params = [p for p in inspect.signature(method).parameters if p != "self"]
    assert params == DATA_TABLE_METHODS[name], f"DataTable.{name} now takes {params}"


def test_data_table_private_modules_still_provide_its_row_types() -> None:
    two_way = importlib.import_module("textual._two_way_dict").TwoWayDict
    data_table = importlib.import_module("textual.widgets._data_table")
    row = data_table.Row(data_table.RowKey("k"), 1, None, False)
    assert row.key == "k" and row.height == 1
    assert two_way({data_table.RowKey("k"): 0}).get_key(0) == "k"


def test_fast_data_table_overrides_match_data_tables_signatures() -> None:
    for name in ("_render_cell", "_render_line_in_row", "_get_row_style", "_update_dimensions"):
        mine = list(inspect.signature(getattr(FastDataTable, name)).parameters)
        theirs = list(inspect.signature(getattr(DataTable, name)).parameters)
        assert mine == theirs, f"FastDataTable.{name}{mine} no longer matches DataTable's {theirs}"


def test_header_still_mounts_through_a_private_handler_and_draws_a_header_title() -> None:
    assert "_on_mount" in vars(Header), "Header no longer has _on_mount: console/tui/compat/header.py's override does nothing"
    assert importlib.import_module("textual.widgets._header").HeaderTitle


def test_every_message_still_passes_through_message_pumps_private_on_message() -> None:
    handler = vars(MessagePump).get("_on_message")
    assert handler is not None and inspect.iscoroutinefunction(handler)
    assert list(inspect.signature(handler).parameters) == ["self", "message"]


def test_footer_still_waits_for_its_private_bindings_ready_flag() -> None:
    footer = Footer()
    assert footer._bindings_ready is False, "Footer no longer has _bindings_ready: console/tui/compat/footer.py sets a dead field"
    assert "bindings_changed" in vars(Footer)


def test_textual_still_has_its_light_ansi_palette() -> None:
    assert isinstance(importlib.import_module("textual._ansi_theme").ALABASTER, TerminalTheme)
    bg, fg, colors = light_ansi()
    assert len(colors) == 16 and all(len(c) == 3 for c in (bg, fg, *colors))


def test_asyncssh_still_reads_options_through_a_handler_table() -> None:
    handlers = asyncssh.config.SSHClientConfig._handlers
    assert isinstance(handlers, dict) and "hostkeyalias" in handlers
    assert callable(asyncssh.config.SSHConfig._set_bool)
    assert "checkhostip" not in handlers, "asyncssh now reads CheckHostIP itself: console/fleet/compat.py's CheckHostIPConfig can go"
    assert fleet_compat.CheckHostIPConfig._handlers["checkhostip"][0] == "CheckHostIP"


def test_asyncssh_logger_still_keeps_its_debug_level_on_the_class() -> None:
    level = getattr(type(asyncssh.logging.logger), "_debug_level", None)
    assert isinstance(level, int), "asyncssh's logger no longer has _debug_level: packet_logging_on() always says yes"
    old = level
    try:
        asyncssh.set_debug_level(1)
        assert not fleet_compat.packet_logging_on()
        asyncssh.set_debug_level(3)
        assert fleet_compat.packet_logging_on()
    finally:
        asyncssh.set_debug_level(old)
