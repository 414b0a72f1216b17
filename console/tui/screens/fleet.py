"""Provides the Fleet screen: one row per host, updated in place by row key (256 hosts scroll and update smoothly)."""

from __future__ import annotations

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding

from gpudeck.console.core.fmt import gib
from gpudeck.console.core.records import HostStatus
from gpudeck.console.present.formats import why_down
from gpudeck.console.present.views import HostFigures, age, host_figures, since, stamp
from gpudeck.console.tui.screens.base import LiveScreen, deck
from gpudeck.console.tui.widgets.cells import SIMULATED, alerts_text, mem_bar, memo, pct_bar, sortable, state_text, styled
from gpudeck.console.tui.widgets.footer import DeckFooter
from gpudeck.console.tui.widgets.header import AppHeader
from gpudeck.console.tui.widgets.keyed_table import Col, KeyedTable, fit
from gpudeck.console.tui.widgets.steady import SteadyText
from gpudeck.console.watch.outbox import failing_summary
from gpudeck.console.watch.service import outbox_path

COLUMNS = [
    Col("host", "HOST", 18),
    Col("state", "STATE", 16),
    Col("since", "SINCE", 12, fold=2),  # when the link state began (unreachable since: the first failure, not the last retry)
    Col("gpus", "GPUs BUSY", 9, fold=4),
    Col("memory", "MEMORY", 26),
    Col("util", "UTIL", 10, fold=3),
    Col("runs", "RUNS", 4),
    Col("agent", "AGENT", 8, fold=1),
    Col("alerts", "ALERTS / LINK", None),  # what the terminal leaves (fitted again on resize: see keyed_table.fit)
]
NOT_UP_REFRESH_S = 1.0  # 'unreachable 5m ago' and 'connecting 3s' count on screen
NOTIFY_CHECK_S = 10.0  # how often the Fleet looks at gpudeck watch's outbox for failing notification targets


def down_since(st: HostStatus) -> float:
    """When the host stopped answering (the first failure; retries in between do not move it)."""
    return st.down_since if st.state == "unreachable" and st.down_since else st.since


def state_cell(st: HostStatus) -> Text:
    """The link state in a word or two, with how long it has lasted when it is not up: 'unreachable 5m ago'."""
    if st.state == "unreachable":
        return state_text("unreachable", age(down_since(st)).removesuffix(" ago"))
    if st.state == "connecting":
        return state_text("connecting", f"{since(st.since)}" + (f" #{st.connects + 1}" if st.connects else ""))
    return state_text(st.state)


@memo
def host_label(name: str, simulated: bool) -> Text:
    """The host column: its name in bold, SIMULATED after it where the host is (shared: see cells.py's note)."""
    label = Text(name, style="bold")
    if simulated:
        label.append(" ")
        label.append_text(SIMULATED)
    return label


def host_cells(st: HostStatus) -> tuple[dict[str, object], HostFigures | None]:
    """The cells of one host's row, and its figures (None when it is not up). Cells that did not change are the
    same objects as last time (cells.py's ``memo``): a row rebuilt every second makes nothing new for them."""
    snap = st.snapshot
    cells: dict[str, object] = {
        "host": host_label(st.name, snap is not None and snap.simulated),
        "state": state_cell(st),
        "since": sortable(stamp(down_since(st)), down_since(st)) if st.state != "up" else styled(stamp(st.since), "dim"),
        "agent": styled(st.agent_version or "-", "dim"),
        "gpus": "-",
        "memory": "-",
        "util": "-",
        "runs": "-",
        "alerts": styled(""),
    }
    if st.state != "up" or snap is None:
        if st.error:
            # host_key and version_mismatch say what to do; unreachable says why
            cells["alerts"] = styled(
                (f"since {stamp(down_since(st))}: " if st.state == "unreachable" else "") + why_down(st.name, st.error),
                "bold magenta" if st.state in ("host_key", "version_mismatch") else "red",
            )
        return cells, None
    fig = host_figures(snap)
    if fig.gpus:
        cells["gpus"] = f"{fig.busy}/{fig.gpus}"
        cells["memory"] = mem_bar(fig.used, fig.total, width=10)
        cells["util"] = pct_bar(fig.util)
    else:
        cells["gpus"] = styled("no GPU", "dim")
    cells["runs"] = str(fig.runs)
    cells["alerts"] = alerts_text(fig.alerts, fig.critical)
    if not fig.gpus and not fig.alerts and snap.gpu_error:
        cells["alerts"] = styled(snap.gpu_error, "dim")  # why there are no GPUs, in the column that has the room
    return cells, fig


class FleetScreen(LiveScreen):
    """Every host at a glance; enter opens a host."""

    BINDINGS = [
        Binding("enter", "open_host", "Open host", tooltip="GPUs and processes of the highlighted host"),
        Binding("a", "next_alert", "Next alert", tooltip="move to the next host with an alert or a link problem"),
    ]

    def compose(self) -> ComposeResult:
        yield AppHeader()
        yield SteadyText("Fleet", id="fleet-summary", classes="title")  # changes with every delivery: lays out only when its size may
        yield KeyedTable(fit(COLUMNS, self.app.size.width), id="fleet-table", fold_from=COLUMNS)
        yield DeckFooter()

    def on_mount(self) -> None:
        self._figures: dict[str, HostFigures | None] = {}
        self._states: dict[str, str] = {}
        self._notify_note: str | None = None
        self.hosts_changed(set(deck(self).ops.links))
        self.set_interval(NOT_UP_REFRESH_S, self._tick)
        self._check_notify()
        self.set_interval(NOTIFY_CHECK_S, self._check_notify)

    @work(thread=True, exclusive=True, group="notify-check")
    def _check_notify(self) -> None:
        """gpudeck watch's failing notification targets (read-only, from its outbox: SQLite, so off the loop)."""
        note = failing_summary(outbox_path())
        if note != self._notify_note:
            self._notify_note = note
            self.app.call_from_thread(self._summary)

    def _tick(self) -> None:
        if self.app.screen is not self:
            return
        waiting = {h for h, s in self._states.items() if s != "up"}
        if waiting:
            self.hosts_changed(waiting)

    def hosts_changed(self, names: set[str]) -> None:
        """Update (or add) the rows of these hosts only."""
        table = self.query_one("#fleet-table", KeyedTable)
        links = deck(self).ops.links
        for name in [n for n in names if n not in links]:  # removed from the config (`gpudeck hosts remove`)
            table.drop(name)
            self._figures.pop(name, None)
            self._states.pop(name, None)
        for name in [n for n in links if n in names]:  # config order for new rows
            st = links[name].status
            cells, fig = host_cells(st)
            table.upsert(name, cells)
            self._figures[name] = fig
            self._states[name] = st.state
        self._summary()

    def _summary(self) -> None:
        states = list(self._states.values())
        figs = [f for f in self._figures.values() if f is not None]
        t = Text()
        t.append(f"Fleet: {len(states)} host(s)", style="bold")
        t.append(f"  {states.count('up')} up", style="green")
        for state, label, style in (
            ("connecting", "connecting", "yellow"),
            ("unreachable", "unreachable", "bold red"),
            ("host_key", "host key refused", "bold magenta"),
            ("version_mismatch", "version mismatch", "bold magenta"),
        ):
            n = states.count(state)
            if n:
                t.append(f"  {n} {label}", style=style)
        gpus = sum(f.gpus for f in figs)
        t.append(
            f"   GPUs {sum(f.busy for f in figs)}/{gpus} busy   {gib(sum(f.used for f in figs))}/{gib(sum(f.total for f in figs))} GiB   runs {sum(f.runs for f in figs)}"
        )
        alerts = sum(len(f.alerts) for f in figs)
        if alerts:
            t.append(f"   ⚠ {alerts} alert(s)", style="bold red")
        if self._notify_note:
            t.append(f"\n{self._notify_note}", style="bold yellow")
        self.query_one("#fleet-summary", SteadyText).show(t)

    def action_next_alert(self) -> None:
        table = self.query_one("#fleet-table", KeyedTable)
        keys = table.keys()
        if not keys:
            return
        cur = table.cursor_row
        for i in range(1, len(keys) + 1):
            k = keys[(cur + i) % len(keys)]
            fig = self._figures.get(k)
            if self._states.get(k) != "up" or (fig is not None and fig.alerts):
                table.move_cursor_to_key(k)
                return
        self.notify("no host has an alert or a link problem")

    def action_open_host(self) -> None:
        key = self.query_one("#fleet-table", KeyedTable).cursor_key
        if key is not None:
            deck(self).open_host(key)

    def on_data_table_row_selected(self, event: KeyedTable.RowSelected) -> None:
        deck(self).open_host(str(event.row_key.value))
