"""Provides the Launch dialog: host (or hosts), GPUs (with free memory and holders), kind, arguments, ranks, python, an
explicit start, then the pre-flight result before the final confirm, and the launch itself with its progress.

The dialog only collects the form (:class:`LaunchForm`) and shows results: the
form becomes a :class:`~gpudeck.console.ops.LaunchIntent` and the operations layer
plans it (the same spec the CLI builds for the same intent) and launches it.
ctrl+s first runs pre-flight on the chosen host(s) (nothing starts); the result
shows in the dialog and the button turns into the final confirm. Changing any
field afterwards asks for pre-flight again. When stale or foreign processes of
the operator's hold the GPUs (the GPU-holder check, and the memory they hold),
the first action is "Reclaim these and launch": it lists exactly those pids
(user, run, GiB, age), asks once, reclaims them (the verified GiB freed per
GPU), pre-flights again and launches, all through
:func:`~gpudeck.console.ops.holders.reclaim_and_launch` (what ``gpudeck launch
--reclaim-holders`` runs). "Launch with --force" (ctrl+f, recorded by the
agent) is the second choice.
"""

from __future__ import annotations

import dataclasses
import shlex
import uuid
from dataclasses import dataclass

import msgspec
from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Select, SelectionList, Static
from textual.widgets.selection_list import Selection

from gpudeck.agents.wire.errors import AgentError
from gpudeck.agents.wire.protocol import Gpu, LaunchSpec, PreflightResult, RunInfo, Snapshot, new_run_id
from gpudeck.console.core.fmt import gib
from gpudeck.console.core.sanitize import escape_controls, one_line
from gpudeck.console.ops import IntentError, LaunchIntent, LaunchPlan, LaunchResult, OpsError
from gpudeck.console.ops.holders import HOLDERS_CHECK, HolderPlan, ReclaimLaunch
from gpudeck.console.ops.intent import count_text, form_start
from gpudeck.console.ops.launch import NodeOutcome
from gpudeck.console.present.views import gpu_free, holder_label
from gpudeck.console.tui.screens.base import Guarded, deck
from gpudeck.console.tui.screens.dialogs import ConfirmDialog
from gpudeck.console.tui.widgets.cells import SIMULATED, plain_markup
from gpudeck.console.tui.widgets.progress import ProgressLine


@dataclass(frozen=True)
class LaunchForm:
    """What the dialog's fields hold, as typed."""

    host: str
    kind: str = "command"
    args: str = ""
    name: str = ""
    gpus: str = ""
    ranks: str = ""
    hosts: str = ""
    python: str = ""
    start: str = ""  # fresh | resume | ''
    resume_step: str = ""
    need_gib: str = ""  # GiB each GPU needs (what pre-flight checks the free memory against); '' estimates / skips


@dataclass(frozen=True)
class LaunchOutcome:
    """What the dialog returns: the launch's result (the run that started, or what refused it)."""

    result: LaunchResult

    @property
    def host(self) -> str:
        """The first node's host."""
        return self.result.nodes[0].host

    @property
    def run(self) -> RunInfo:
        """The first node's run."""
        reply = self.result.nodes[0].reply
        assert reply is not None
        return reply.run

    @property
    def spec(self) -> LaunchSpec:
        """The first node's spec."""
        return self.result.plan.spec


def form_from(intent: LaunchIntent) -> dict[str, str]:
    """The form's fields for an intent (a relaunch's: the same run, with the start left for the operator)."""
    return {
        "kind": intent.kind,
        "args": shlex.join(intent.argv),
        "name": intent.name or "",
        "gpus": intent.gpus or "",
        "ranks": str(intent.nproc_per_node) if intent.nproc_per_node else "",
        "hosts": ",".join(intent.hosts),
        "python": intent.python or "",
        "need_gib": f"{intent.need_gib:g}" if intent.need_gib is not None else "",
    }


# A form field filled from a recorded run shows the value as one row (controls escaped, line breaks too) and at most this
# many characters; left as shown, the recorded value itself is launched (its bytes exactly, not the escapes).
FIELD_LIMIT = 4096
FIELD_INPUTS = ("args", "name", "python", "ranks", "hosts", "need_gib")  # the Input fields a prefill fills


def shown_fields(prefill: dict[str, str]) -> dict[str, str]:
    """What each prefilled Input field shows: :func:`one_line` of the recorded value, cut at FIELD_LIMIT."""
    return {f: one_line(v, FIELD_LIMIT) for f, v in prefill.items() if f in FIELD_INPUTS}


def typed_or_recorded(field: str, value: str, prefill: dict[str, str], shown: dict[str, str]) -> str:
    """The value a field stands for: the recorded one when the field still shows it unchanged, else what was typed.

    A field whose recorded value was cut for showing and then edited, with the cut mark (…) still in it, is refused:
    launching the cut value would silently drop the rest."""
    if field not in shown:
        return value
    if value == shown[field]:
        return prefill[field]
    if shown[field] != escape_controls(prefill[field]) and "…" in value:  # shown cut, not only escaped
        raise IntentError(
            field.replace("_", " "),
            f"the recorded value is {len(prefill[field])} characters, shown cut at {FIELD_LIMIT}, and was edited",
            "clear the field and type the whole value, or cancel and relaunch to use the recorded one",
        )
    return value


def need_gib_text(text: str) -> float | None:
    """The need-GiB field as a number (None when empty); IntentError names the field (the CLI's --need-gib)."""
    text = text.strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        raise IntentError("need GiB", f"{text!r} is not a number", "give the GiB each GPU needs, e.g. 40, or leave it empty") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise IntentError("need GiB", f"{text!r} is not a number", "give the GiB each GPU needs, e.g. 40, or leave it empty")
    return value


def intent_from_form(form: LaunchForm, base: LaunchIntent | None = None) -> LaunchIntent:
    """The form as an intent (what it does not show carries over from ``base``); IntentError names the field."""
    try:
        argv = tuple(shlex.split(form.args))
    except ValueError as exc:
        raise IntentError("arguments", str(exc), "close the quote or escape the character") from None
    return dataclasses.replace(
        base or LaunchIntent(),
        host=form.host,
        kind=form.kind,
        argv=argv,
        name=form.name.strip() or None,
        gpus=form.gpus.strip() or None,
        nproc_per_node=count_text(
            form.ranks, "ranks per node", "give how many ranks each host starts (1 or more), or leave it out: one per GPU"
        ),
        hosts=tuple(h.strip() for h in form.hosts.split(",") if h.strip()),
        python=form.python.strip() or None,
        start=form_start(form.start, form.resume_step),
        need_gib=need_gib_text(form.need_gib),
    )


def gpu_choice(g: Gpu, host_simulated: bool) -> Text:
    """One GPU in the picker: index, name, free memory, and who holds the rest."""
    t = Text()
    t.append(f"GPU {g.index}  ", style="bold")
    t.append(f"{gib(gpu_free(g)):>6} GiB free of {gib(g.memory_total)}  ")
    if not g.processes:
        t.append("free", style="green")
    for i, p in enumerate(g.processes[:3]):
        if i:
            t.append(", ")
        bad = p.attribution in ("STALE", "FOREIGN", "NO_SUCH_PROCESS")
        t.append(f"pid {p.pid} {holder_label(p)} {gib(p.used_bytes)}G", style="bold red" if bad else "")
    if len(g.processes) > 3:
        t.append(f" +{len(g.processes) - 3} more")
    if host_simulated:
        t.append("  (simulated)", style="dim")
    return t


def preflight_text(result: PreflightResult | None, error: str | None, host: str) -> Text:
    """The pre-flight verdict and every check, as the dialog shows it before the final confirm."""
    t = Text()
    if result is None:
        t.append(f"pre-flight could not run on {host}: ", style="bold yellow")
        t.append(f"{error}\n", style="yellow")
        t.append("The agent still checks the launch itself; ctrl+s launches anyway.", style="dim")
        return t
    failed = [c for c in result.checks if not c.ok and not c.overridden]
    if failed:
        t.append(
            f"pre-flight on {result.host or host}: FAILED ({len(failed)} of {len(result.checks)} checks) — nothing was started\n",
            style="bold red",
        )
    else:
        t.append(
            f"pre-flight on {result.host or host}: ok"
            + (" (forced past the GPU holders)" if result.forced else "")
            + f" in {result.seconds:.1f} s\n",
            style="bold green",
        )
    for c in result.checks:
        if c.overridden:
            mark, style = "forced", "yellow"
        elif not c.ok:
            mark, style = "✗", "bold red"
        elif c.details.get("skipped"):
            mark, style = "–", "dim"
        else:
            mark, style = "✓", "green"
        t.append(f"  {mark:<6} {c.name:<18} ", style=style)
        t.append(f"{one_line(c.message)}\n", style="red" if not c.ok and not c.overridden else "")
    if result.estimate is not None and result.estimate.method:
        t.append(f"  memory per GPU: {gib(result.estimate.per_gpu_bytes)} GiB — {result.estimate.method}\n", style="dim")
    return t


def holders_text(holders: HolderPlan, confirm: bool = False) -> Text:
    """The processes "Reclaim these and launch" stops (pid, user, run, GiB, age), the refused ones named as such."""
    t = Text()
    if confirm:
        t.append("These processes are stopped (SIGTERM, grace, SIGKILL; NVML verifies the memory came back), then pre-flight runs ")
        t.append("again and the run launches if it passes:\n")
    else:
        t.append(f"GPU holders reclaim-and-launch would stop ({len(holders.to_stop)}):\n", style="bold")
    for h in holders.holders:
        t.append(f"  {h.line()}\n", style="bold red" if h.refused else "")
    if holders.blocked and not confirm:
        t.append(f"Reclaim-and-launch is not offered: {holders.blocked}\n", style="yellow")
    return t


def only_holders_failed(result: PreflightResult) -> bool:
    """Whether --force would get past this result (only the GPU-holder check may be overridden)."""
    failed = [c for c in result.checks if not c.ok and not c.overridden]
    return bool(failed) and all(c.name == "gpu_holders" for c in failed)


class LaunchDialog(Guarded, ModalScreen[LaunchOutcome | None]):
    """The launch form: fill it in, pre-flight, confirm, launch."""

    BINDINGS = [
        Binding("escape", "cancel", "Cancel"),
        Binding("ctrl+s", "submit", "Pre-flight / Launch", tooltip="first: pre-flight on the host (nothing starts); then: launch"),
        Binding("ctrl+f", "force", "Launch with --force", show=False, tooltip="after pre-flight named GPU holders: launch past them"),
        Binding(
            "ctrl+g",
            "allow_env",
            "Launch past the nodes' differences",
            show=False,
            tooltip="after the cross-node gate refused: launch allowing exactly the rows it named (recorded with the run)",
        ),
        # priority: the next field gets focus before the keys typed after tab are delivered (a fast typist, a paste)
        Binding("tab", "app.focus_next", show=False, priority=True),
        Binding("shift+tab", "app.focus_previous", show=False, priority=True),
    ]

    def __init__(self, prefill: LaunchIntent | None = None, host: str | None = None, title: str | None = None) -> None:
        super().__init__()
        self._base = prefill
        self._prefill = form_from(prefill) if prefill is not None else {}
        self._shown = shown_fields(self._prefill)  # what the prefilled fields show (run-controlled: escaped, one row)
        self._parent_run = prefill.parent if prefill is not None else None
        self._first_host = host
        self._title = title
        self._checked: bytes | None = None  # the plan that pre-flight ran on
        self._result: list[NodeOutcome] | None = None
        self._request_id = f"console-{uuid.uuid4().hex[:12]}"  # a retried launch from this dialog never starts a second run
        self._run_id = new_run_id()  # a multi-node plan keeps its id while the form is checked and confirmed
        self._gpu_host: str | None = None
        self._gpu_simulated = False
        self._armed = False
        self._gate_names: tuple[str, ...] = ()  # the rows the cross-node gate refused on, for ctrl+g (--allow-env-diff)
        self._holders: HolderPlan | None = None  # what "Reclaim these and launch" stops (None: not offered)
        self._forcible = False  # only the GPU-holder check failed: --force is a choice

    def compose(self) -> ComposeResult:
        hosts = list(deck(self).ops.links)
        if self._first_host in hosts:
            hosts.remove(self._first_host)
            hosts.insert(0, self._first_host)
        with VerticalScroll(classes="dialog wide", id="launch-dialog"):
            title = self._title or (f"Relaunch {self._parent_run}: choose the start again" if self._parent_run else "Launch a run")
            yield Static(plain_markup(one_line(f"{title}  (ctrl+s: pre-flight, then launch; esc cancels)")), classes="dialog-title")
            with Horizontal(classes="field"):
                yield Label("Host")
                yield Select([(h, h) for h in hosts], value=hosts[0], id="host", allow_blank=False, compact=True)
            with Horizontal(classes="field"):
                yield Label("GPUs")
                with Vertical(classes="gpu-box"):
                    yield SelectionList[int](id="gpus")
                    yield Static("", id="gpu-hint", classes="hint")
            with Horizontal(classes="field"):
                yield Label("Kind")
                yield Select(
                    [("command", "command"), ("fsdp (gpudeck.trainers.fsdp_lm)", "fsdp"), ("dflash (gpudeck.trainers.dflash)", "dflash")],
                    value="command",
                    id="kind",
                    allow_blank=False,
                    compact=True,
                )
            with Horizontal(classes="field"):
                yield Label("Arguments")
                yield Input(id="args", placeholder="python train.py --lr 3e-4  (for trainers: their options)", compact=True)
            with Horizontal(classes="field"):
                yield Label("Name")
                yield Input(id="name", placeholder="optional", compact=True)
            with Horizontal(classes="field"):
                yield Label("Python")
                yield Input(id="python", placeholder="python3 (the host's; a local run: this shell's PATH)", compact=True)
            with Horizontal(classes="field"):
                yield Label("Ranks/host")
                yield Input(id="ranks", placeholder="1/GPU", classes="narrow", compact=True)
                yield Input(id="hosts", placeholder="several hosts for one run: gpu1,gpu2 (the host above is then not used)", compact=True)
            with Horizontal(classes="field"):
                yield Label("Need GiB")
                yield Input(
                    id="need-gib",
                    placeholder="GiB per GPU (as --need-gib): pre-flight checks the free memory; fsdp/dflash: estimated",
                    compact=True,
                )
            with Horizontal(classes="field"):
                yield Label("Start")
                yield Select(
                    [("fresh: step 0, new checkpoints", "fresh"), ("resume at step N", "resume")],
                    id="start",
                    prompt="trainers: choose fresh or resume (no default)",
                    compact=True,
                )
                yield Input(id="resume-step", placeholder="N", classes="narrow", compact=True)
            yield Static("", id="launch-error", classes="error")
            yield Static(
                Text("ctrl+s runs pre-flight on the host first: nothing starts until you confirm its result.", style="dim"),
                id="preflight",
                classes="preflight",
            )
            yield ProgressLine(id="launch-progress")
            with Horizontal(classes="dialog-buttons"):
                yield Button("Pre-flight (ctrl+s)", variant="primary", id="launch")
                yield Button("Launch with --force (ctrl+f)", variant="error", id="force")
                yield Button("Launch past these differences (ctrl+g)", variant="warning", id="allow-env")
                yield Button("Cancel (esc)", id="cancel")

    def on_mount(self) -> None:
        for field, shown in self._shown.items():
            self.query_one(f"#{field.replace('_', '-')}", Input).value = shown
        if "kind" in self._prefill:
            self.query_one("#kind", Select).value = self._prefill["kind"]
        self._fill_gpus(str(self.query_one("#host", Select).value))
        self.query_one("#force", Button).display = False
        self.query_one("#allow-env", Button).display = False
        self.query_one("#args", Input).focus()
        self.call_after_refresh(self._arm)

    def _arm(self) -> None:
        self._armed = True  # the prefill's own Changed events are not edits

    # ------------------------------------------------------------------ GPUs

    def _snapshot(self, host: str) -> Snapshot | None:
        link = deck(self).ops.links.get(host)
        return None if link is None else link.status.snapshot

    def _fill_gpus(self, host: str) -> None:
        if host == self._gpu_host:
            return
        self._gpu_host = host
        picker = self.query_one("#gpus", SelectionList)
        hint = self.query_one("#gpu-hint", Static)
        picker.clear_options()
        snap = self._snapshot(host)
        want: set[int] = set()
        if self._prefill.get("gpus"):
            from gpudeck.trainers.contract import parse_index_list

            want = set(parse_index_list(self._prefill["gpus"]))
        if snap is None:
            picker.display = False
            hint.update(Text(one_line(f"no snapshot of {host} yet: the run gets the GPUs its command picks"), style="dim"))
            return
        if not snap.gpus:
            picker.display = False
            hint.update(Text(one_line(f"no GPUs on {host}: {snap.gpu_error}"), style="dim"))
            return
        picker.display = True
        picker.add_options([Selection(gpu_choice(g, snap.simulated), g.index, g.index in want) for g in snap.gpus])
        self._gpu_simulated = snap.simulated
        self._say_gpus()

    def _say_gpus(self) -> None:
        """The hint under the GPU list: which GPUs are marked (what CUDA_VISIBLE_DEVICES becomes), SIMULATED where so."""
        picker = self.query_one("#gpus", SelectionList)
        if not picker.display:
            return
        marked = sorted(picker.selected)
        t = Text(
            f"marked: GPU {', '.join(map(str, marked))} (CUDA_VISIBLE_DEVICES={','.join(map(str, marked))})"
            if marked
            else "none marked: CUDA_VISIBLE_DEVICES is left alone",
            style="" if marked else "dim",
        )
        if self._gpu_simulated:
            t = Text.assemble(SIMULATED, Text(" GPUs of this host are simulated; ", style="dim"), t)
        self.query_one("#gpu-hint", Static).update(t)

    def _gpus_text(self) -> str:
        picker = self.query_one("#gpus", SelectionList)
        return ",".join(str(i) for i in sorted(picker.selected)) if picker.display else self._prefill.get("gpus", "")

    # ------------------------------------------------------------------ edits invalidate the pre-flight

    def _edited(self) -> None:
        if not self._armed:
            return
        self.query_one("#launch-error", Static).update("")
        if self._checked is not None:
            self._checked = None
            self._result = None
            self._offer(None, forcible=False)
            self._allow_gate(())
            self.query_one("#preflight", Static).update(Text("the form changed: ctrl+s runs pre-flight again", style="yellow"))
            self._button("Pre-flight (ctrl+s)", disabled=False)

    def on_input_changed(self, event: Input.Changed) -> None:
        self._edited()

    def on_select_changed(self, event: Select.Changed) -> None:
        if event.select.id == "host" and event.value != Select.NULL:
            self._fill_gpus(str(event.value))
        self._edited()

    def on_selection_list_selected_changed(self, event: SelectionList.SelectedChanged) -> None:
        self._say_gpus()
        self._edited()

    def _button(self, label: str, disabled: bool = False, variant: str = "primary") -> None:
        b = self.query_one("#launch", Button)
        b.label = label
        b.disabled = disabled
        b.variant = variant

    # ------------------------------------------------------------------ submit

    def form(self) -> LaunchForm:
        """What the fields hold."""

        def val(wid: str) -> str:
            field = wid.replace("-", "_")
            return typed_or_recorded(field, self.query_one(f"#{wid}", Input).value, self._prefill, self._shown)

        start = self.query_one("#start", Select).value
        return LaunchForm(
            host=str(self.query_one("#host", Select).value),
            kind=str(self.query_one("#kind", Select).value),
            args=val("args"),
            name=val("name"),
            gpus=self._gpus_text(),
            ranks=val("ranks"),
            hosts=val("hosts"),
            python=val("python"),
            start="" if start == Select.NULL else str(start),
            resume_step=val("resume-step"),
            need_gib=val("need-gib"),
        )

    def plan(self, force: bool = False, allow_env_diff: tuple[str, ...] = ()) -> LaunchPlan:
        """The form planned by the operations layer; IntentError says which field to fix. ``allow_env_diff``: the
        cross-node gate's rows to launch past (``--allow-env-diff``, recorded with the run)."""
        intent = intent_from_form(self.form(), self._base)
        if force:
            intent = dataclasses.replace(intent, force=True)
        if allow_env_diff:
            intent = dataclasses.replace(intent, allow_env_diff=tuple(sorted({*intent.allow_env_diff, *allow_env_diff})))
        return deck(self).ops.plan(intent, run_id=self._run_id)

    def submit(self) -> None:
        """ctrl+s: pre-flight the form, or launch what pre-flight accepted."""
        if self.query_one("#launch-progress", ProgressLine).running:
            return
        try:
            plan = self.plan()
        except OpsError as exc:
            self.query_one("#launch-error", Static).update(plain_markup(Text(exc.message, style="bold red")))
            return
        key = msgspec.json.encode([list(n) for n in plan.nodes])
        if self._checked == key and self._holders is not None:
            self.reclaim_then_launch(plan, self._holders)
            return
        if self._checked == key:
            results = self._result or []
            bad = [c.preflight for c in results if c.preflight is not None and not c.preflight.ok]
            if bad:
                if not all(only_holders_failed(r) for r in bad):
                    self.query_one("#launch-error", Static).update(
                        Text("pre-flight failed: fix what it says, then ctrl+s checks again", style="bold red")
                    )
                    return
                plan = self.plan(force=True)
            self.launch(plan)
        else:
            self.preflight(plan, key)

    @work(exclusive=True, group="launch-preflight")
    async def preflight(self, plan: LaunchPlan, key: bytes) -> None:
        """Pre-flight on every host of the plan; the result decides what the confirm button does."""
        progress = self.query_one("#launch-progress", ProgressLine)
        panel = self.query_one("#preflight", Static)
        where = ", ".join(plan.hosts)
        self._button("Pre-flight running ...", disabled=True)
        progress.start(f"pre-flight on {where}", "GPUs, memory, holders, rendezvous port, disk, python, start")
        results = await deck(self).ops.preflight(plan)
        text = Text()
        for i, c in enumerate(results):
            if i:
                text.append("\n")
            text.append_text(preflight_text(c.preflight, c.error, c.host))
        checked = [c.preflight for c in results if c.preflight is not None]
        forcible = all(r.ok or only_holders_failed(r) for r in checked)
        holders = None
        if not any(c.error is not None for c in results) and any(
            c.name == HOLDERS_CHECK and not c.ok and not c.overridden and c.details.get("holders") for r in checked for c in r.checks
        ):
            progress.note(f"pre-flight on {where}: naming the GPU holders")
            holders = await deck(self).ops.plan_holders(plan, results)
            if holders.holders:
                text = Text.assemble(text, "\n", holders_text(holders))
            if holders.blocked:
                holders = None
        took = progress.finish("")
        if took >= 1:
            progress.update(Text(f"pre-flight took {took:.1f} s", style="dim"))
        self._checked = key
        self._result = results
        panel.update(plain_markup(text))
        panel.scroll_visible()
        if any(c.error is not None for c in results):
            self._button("Launch anyway (ctrl+s)", variant="warning")
        elif all(r.ok for r in checked):
            self._button("Launch (ctrl+s)", variant="success")
        elif holders is not None:
            self._button("Reclaim these and launch (ctrl+s)", variant="success")
        elif forcible:
            self._button("Launch with --force (ctrl+s)", variant="error")
        else:
            self._button("Pre-flight failed", disabled=True, variant="error")
        self._offer(holders, forcible=forcible and holders is not None)

    @work(exclusive=True, group="launch-run")
    async def launch(self, plan: LaunchPlan) -> None:
        """Launch what was confirmed; the dialog stays (with the error) if the agent refuses."""
        progress = self.query_one("#launch-progress", ProgressLine)
        self._button("Launching ...", disabled=True)
        progress.start(f"launching on {', '.join(plan.hosts)}", "the agent records the spec, checks and starts the processes")
        try:
            result = await deck(self).ops.launch(plan, request_id=self._request_id)
        except (AgentError, OpsError) as exc:
            progress.finish(f"launch failed: {exc.message}", style="bold red")
            self.query_one("#launch-error", Static).update(plain_markup(Text(exc.message, style="bold red")))
            self._button("Launch (ctrl+s)")
            return
        if result.verdict != "running" and plan.multinode:
            why = "; ".join(f"{n.host}: {n.error or 'pre-flight failed'}" for n in result.failed)
            gate = result.gate if result.gate is not None and result.gate.refused else None
            said = f"nothing runs on any host: {why}"
            if gate is not None:  # the cross-node gate: its headline, table, who differs, the way past (here: ctrl+g too)
                said = "\n".join(
                    [
                        *([said] if why else []),
                        *gate.refusal(),
                        "or press ctrl+g here: launch past exactly these rows (recorded with the run on every node)",
                    ]
                )
            progress.finish(f"{result.run_id}: {result.verdict}", style="bold red")
            self.query_one("#launch-error", Static).update(plain_markup(Text(said, style="bold red")))
            self._button("Launch (ctrl+s)")
            self._allow_gate(tuple(r.name for r in gate.rows) if gate is not None else ())
            return
        progress.finish(f"{result.run_id}: {result.verdict}")
        self.dismiss(LaunchOutcome(result))

    def _allow_gate(self, names: tuple[str, ...]) -> None:
        """After the cross-node gate refused: offer to launch past exactly its rows (none: the offer goes)."""
        self._gate_names = names
        self.query_one("#allow-env", Button).display = bool(names)

    def _offer(self, holders: HolderPlan | None, forcible: bool) -> None:
        """What pre-flight leaves to choose: reclaim these holders (first), launch with --force (second)."""
        self._holders = holders
        self._forcible = forcible
        self.query_one("#force", Button).display = forcible

    @work(exclusive=True, group="launch-run")
    async def reclaim_then_launch(self, plan: LaunchPlan, holders: HolderPlan) -> None:
        """Ask once with exactly the pids that go, then reclaim (verified), pre-flight again and launch."""
        ok = await self.app.push_screen_wait(
            ConfirmDialog(
                "Reclaim these and launch",
                holders_text(holders, confirm=True),
                confirm_label=f"Reclaim {len(holders.to_stop)} and launch",
            )
        )
        if not ok:
            return
        progress = self.query_one("#launch-progress", ProgressLine)
        panel = self.query_one("#preflight", Static)
        self._button("Reclaiming ...", disabled=True)
        self.query_one("#force", Button).disabled = True
        steps = Text()

        def step(line: str) -> None:
            steps.append(f"{line}\n", style="bold green" if "freed" in line else "")
            panel.update(plain_markup(steps))
            progress.note(line)

        progress.start(f"reclaiming {len(holders.to_stop)} process(es)", "SIGTERM, grace, SIGKILL, verify, pre-flight again, launch")
        done: ReclaimLaunch | None = None
        try:
            done = await deck(self).ops.reclaim_and_launch(plan, holders, request_id=self._request_id, step=step)
            why = done.refused or ""
        except (AgentError, OpsError) as exc:
            why = exc.message
        self.query_one("#force", Button).disabled = False
        if done is None or done.result is None or done.result.verdict != "running":
            progress.finish(f"reclaim and launch stopped: {why or 'the launch did not start'}", style="bold red")
            self.query_one("#launch-error", Static).update(plain_markup(Text(why or "the launch did not start", style="bold red")))
            self._checked = None  # what holds the GPUs changed: pre-flight again
            self._offer(None, forcible=False)
            self._button("Pre-flight (ctrl+s)")
            return
        progress.finish(f"{done.result.run_id}: {done.result.verdict}")
        self.dismiss(LaunchOutcome(done.result))

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "cancel":
            self.dismiss(None)
            return
        if event.button.id == "force":
            self.action_force()
            return
        if event.button.id == "allow-env":
            self.action_allow_env()
            return
        self.submit()

    def action_submit(self) -> None:
        self.submit()

    def action_force(self) -> None:
        """The second choice after pre-flight named GPU holders: launch past them with --force (recorded)."""
        if not self._forcible or self.query_one("#launch-progress", ProgressLine).running:
            return
        try:
            plan = self.plan(force=True)
        except OpsError as exc:
            self.query_one("#launch-error", Static).update(plain_markup(Text(exc.message, style="bold red")))
            return
        self.launch(plan)

    def action_allow_env(self) -> None:
        """After the cross-node gate refused: launch allowing exactly the rows it named (``--allow-env-diff``, recorded)."""
        if not self._gate_names or self.query_one("#launch-progress", ProgressLine).running:
            return
        try:
            plan = self.plan(allow_env_diff=self._gate_names)
        except OpsError as exc:
            self.query_one("#launch-error", Static).update(plain_markup(Text(exc.message, style="bold red")))
            return
        self._allow_gate(())
        self.launch(plan)

    def action_cancel(self) -> None:
        if self.query_one("#launch-progress", ProgressLine).running and self._checked is not None:
            self.notify("the launch is on its way: wait for the agent's answer", severity="warning")
            return
        self.dismiss(None)
