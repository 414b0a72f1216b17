"""Provides the Launch dialog: host, GPUs (with free memory and holders), kind, arguments, python, an explicit start,
then the pre-flight result before the final confirm, and the launch itself with its progress.

ctrl+s first runs pre-flight on the chosen host (nothing starts); the result
shows in the dialog and the button turns into the final confirm. Changing any
field afterwards asks for pre-flight again. If only the GPU-holder check
failed, the confirm becomes "launch with --force" (the agent records it).
"""

from __future__ import annotations

import shlex
import sys
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

from agents.errors import AgentError
from agents.protocol import LaunchSpec, PreflightResult, RunInfo, Snapshot
from console.fmt import gib
from console.relaunch import with_start
from console.screens.base import Guarded
from console.views import gpu_free, holder_label
from console.widgets.cells import SIMULATED, plain_markup
from console.widgets.progress import ProgressLine

TRAINER_MODULES = {"fsdp": "trainers.fsdp_lm", "dflash": "trainers.dflash"}


@dataclass(frozen=True)
class LaunchRequest:
    """A validated form: the host and the spec to pre-flight and launch."""

    host: str
    spec: LaunchSpec


@dataclass(frozen=True)
class LaunchOutcome:
    """What the dialog returns: the run that started (or was refused by the agent's own pre-flight)."""

    host: str
    run: RunInfo
    spec: LaunchSpec


def prefill_from(spec: LaunchSpec) -> dict[str, str]:
    """The form's fields for relaunching ``spec``: the same run, with the start left for the operator."""
    argv = list(spec.argv)
    python = spec.python or sys.executable
    if spec.kind in TRAINER_MODULES and len(argv) >= 3 and argv[1:3] == ["-m", TRAINER_MODULES[spec.kind]]:
        # the old start never carries over: fresh or resume is chosen again (with_start's own --fresh dropped too)
        python, argv = argv[0], with_start(argv[3:], "fresh")[:-1]
    return {
        "kind": spec.kind,
        "args": shlex.join(argv),
        "name": spec.name or "",
        "gpus": ",".join(map(str, spec.gpus)) if spec.gpus is not None else "",
        "python": python,
    }


def build_spec(kind: str, args: str, name: str, gpus: str, start: str, resume_step: str, python: str) -> LaunchSpec:
    """Turn the form into a spec; ValueError says which field is wrong and how."""
    try:
        argv = shlex.split(args)
    except ValueError as exc:
        raise ValueError(f"arguments: {exc}") from None
    gpu_list = None
    if gpus.strip():
        try:
            gpu_list = [int(g) for g in gpus.replace(" ", "").split(",") if g]
        except ValueError:
            raise ValueError("GPUs: write indices like 0,1") from None
    start_value = None
    spec_python = None
    if kind in TRAINER_MODULES:
        if start not in ("fresh", "resume"):
            raise ValueError("start: choose 'fresh' (step 0, new checkpoints) or 'resume at step N' — there is no default")
        if start == "resume":
            if not resume_step.strip().isdigit():
                raise ValueError("resume: give the checkpoint step N (a number)")
            start_value = f"resume {int(resume_step)}"
            argv += ["--resume", str(int(resume_step))]
        else:
            start_value = "fresh"
            argv += ["--fresh"]
        spec_python = python or sys.executable
        argv = [spec_python, "-m", TRAINER_MODULES[kind], *argv]
    elif not argv:
        raise ValueError("command: give the command to run, e.g. python train.py --lr 3e-4")
    return LaunchSpec(argv=argv, name=name.strip() or None, kind=kind, gpus=gpu_list, start=start_value, python=spec_python)  # type: ignore[arg-type]


def gpu_choice(g, host_simulated: bool) -> Text:  # type: ignore[no-untyped-def]
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
        t.append(f"pre-flight on {result.host or host}: FAILED ({len(failed)} of {len(result.checks)} checks) — nothing was started\n", style="bold red")
    else:
        t.append(f"pre-flight on {result.host or host}: ok" + (" (forced past the GPU holders)" if result.forced else "") + f" in {result.seconds:.1f} s\n", style="bold green")
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
        t.append(f"{c.message}\n", style="red" if not c.ok and not c.overridden else "")
    if result.estimate is not None and result.estimate.method:
        t.append(f"  memory per GPU: {gib(result.estimate.per_gpu_bytes)} GiB — {result.estimate.method}\n", style="dim")
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
        # priority: the next field gets focus before the keys typed after tab are delivered (a fast typist, a paste)
        Binding("tab", "app.focus_next", show=False, priority=True),
        Binding("shift+tab", "app.focus_previous", show=False, priority=True),
    ]

    def __init__(self, prefill: LaunchSpec | None = None, parent: str | None = None, host: str | None = None, title: str | None = None) -> None:
        super().__init__()
        self._prefill_spec = prefill
        self._prefill = prefill_from(prefill) if prefill is not None else {}
        self._parent_run = parent
        self._first_host = host
        self._title = title
        self._checked: bytes | None = None  # the (host, spec) that pre-flight ran on
        self._result: PreflightResult | None = None
        self._request_id = f"console-{uuid.uuid4().hex[:12]}"  # a retried launch from this dialog never starts a second run
        self._gpu_host: str | None = None
        self._armed = False

    def compose(self) -> ComposeResult:
        hosts = list(self.app.fleet.links)  # type: ignore[attr-defined]
        if self._first_host in hosts:
            hosts.remove(self._first_host)
            hosts.insert(0, self._first_host)
        with VerticalScroll(classes="dialog wide", id="launch-dialog"):
            title = self._title or (f"Relaunch {self._parent_run}: choose the start again" if self._parent_run else "Launch a run")
            yield Static(plain_markup(f"{title}  (ctrl+s: pre-flight, then launch; esc cancels)"), classes="dialog-title")
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
                yield Select([("command", "command"), ("fsdp (trainers.fsdp_lm)", "fsdp"), ("dflash (trainers.dflash)", "dflash")], value="command", id="kind", allow_blank=False, compact=True)
            with Horizontal(classes="field"):
                yield Label("Arguments")
                yield Input(id="args", placeholder="python train.py --lr 3e-4  (for trainers: their options)", compact=True)
            with Horizontal(classes="field"):
                yield Label("Name")
                yield Input(id="name", placeholder="optional", compact=True)
            with Horizontal(classes="field"):
                yield Label("Python")
                yield Input(id="python", value=sys.executable, compact=True)
            with Horizontal(classes="field"):
                yield Label("Start")
                yield Select([("fresh: step 0, new checkpoints", "fresh"), ("resume at step N", "resume")], id="start", prompt="trainers: choose fresh or resume (no default)", compact=True)
                yield Input(id="resume-step", placeholder="N", classes="narrow", compact=True)
            yield Static("", id="launch-error", classes="error")
            yield Static(Text("ctrl+s runs pre-flight on the host first: nothing starts until you confirm its result.", style="dim"), id="preflight", classes="preflight")
            yield ProgressLine(id="launch-progress")
            with Horizontal(classes="dialog-buttons"):
                yield Button("Pre-flight (ctrl+s)", variant="primary", id="launch")
                yield Button("Cancel (esc)", id="cancel")

    def on_mount(self) -> None:
        for field in ("args", "name", "python"):
            if field in self._prefill:
                self.query_one(f"#{field}", Input).value = self._prefill[field]
        if "kind" in self._prefill:
            self.query_one("#kind", Select).value = self._prefill["kind"]
        self._fill_gpus(str(self.query_one("#host", Select).value))
        self.query_one("#args", Input).focus()
        self.call_after_refresh(self._arm)

    def _arm(self) -> None:
        self._armed = True  # the prefill's own Changed events are not edits

    # ------------------------------------------------------------------ GPUs

    def _snapshot(self, host: str) -> Snapshot | None:
        link = self.app.fleet.links.get(host)  # type: ignore[attr-defined]
        return None if link is None else link.status.snapshot

    def _fill_gpus(self, host: str) -> None:
        if host == self._gpu_host:
            return
        self._gpu_host = host
        picker = self.query_one("#gpus", SelectionList)
        hint = self.query_one("#gpu-hint", Static)
        picker.clear_options()
        snap = self._snapshot(host)
        want = set(self._prefill_spec.gpus or []) if self._prefill_spec is not None and self._prefill_spec.gpus is not None else set()
        if snap is None:
            picker.display = False
            hint.update(Text(f"no snapshot of {host} yet: the run gets the GPUs its command picks", style="dim"))
            return
        if not snap.gpus:
            picker.display = False
            hint.update(Text(f"no GPUs on {host}: {snap.gpu_error}", style="dim"))
            return
        picker.display = True
        picker.add_options([Selection(gpu_choice(g, snap.simulated), g.index, g.index in want) for g in snap.gpus])
        t = Text("none marked: CUDA_VISIBLE_DEVICES is left alone", style="dim")
        if snap.simulated:
            t = Text.assemble(SIMULATED, Text(" GPUs of this host are simulated; none marked: CUDA_VISIBLE_DEVICES is left alone", style="dim"))
        hint.update(t)

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
            self.query_one("#preflight", Static).update(Text("the form changed: ctrl+s runs pre-flight again", style="yellow"))
            self._button("Pre-flight (ctrl+s)", disabled=False)

    def on_input_changed(self, event: Input.Changed) -> None:
        self._edited()

    def on_select_changed(self, event: Select.Changed) -> None:
        if event.select.id == "host" and event.value != Select.NULL:
            self._fill_gpus(str(event.value))
        self._edited()

    def on_selection_list_selected_changed(self, event: SelectionList.SelectedChanged) -> None:
        self._edited()

    def _button(self, label: str, disabled: bool = False, variant: str = "primary") -> None:
        b = self.query_one("#launch", Button)
        b.label = label
        b.disabled = disabled
        b.variant = variant  # type: ignore[assignment]

    # ------------------------------------------------------------------ submit

    def request(self) -> LaunchRequest:
        """The form as a request; ValueError says which field to fix."""
        val = lambda wid: self.query_one(f"#{wid}", Input).value  # noqa: E731
        start = self.query_one("#start", Select).value
        spec = build_spec(
            kind=str(self.query_one("#kind", Select).value),
            args=val("args"),
            name=val("name"),
            gpus=self._gpus_text(),
            start="" if start == Select.NULL else str(start),
            resume_step=val("resume-step"),
            python=val("python"),
        )
        spec.parent = self._parent_run
        if self._prefill_spec is not None:
            # what the form does not show carries over from the run being relaunched
            spec.env = dict(self._prefill_spec.env)
            spec.cwd = self._prefill_spec.cwd
            spec.checkpoint_dir = self._prefill_spec.checkpoint_dir
            spec.claims = self._prefill_spec.claims
            spec.on_rank_death = self._prefill_spec.on_rank_death
            if spec.python is None and self._prefill_spec.python:
                spec.python = self._prefill_spec.python
        return LaunchRequest(str(self.query_one("#host", Select).value), spec)

    def submit(self) -> None:
        """ctrl+s: pre-flight the form, or launch what pre-flight accepted."""
        if self.query_one("#launch-progress", ProgressLine).running:
            return
        try:
            req = self.request()
        except ValueError as exc:
            self.query_one("#launch-error", Static).update(Text(str(exc), style="bold red"))
            return
        key = msgspec.json.encode([req.host, req.spec])
        if self._checked == key:
            res = self._result
            if res is not None and not res.ok:
                if not only_holders_failed(res):
                    self.query_one("#launch-error", Static).update(Text("pre-flight failed: fix what it says, then ctrl+s checks again", style="bold red"))
                    return
                req = LaunchRequest(req.host, msgspec.structs.replace(req.spec, force=True))
            self.launch(req)
        else:
            self.preflight(req, key)

    @work(exclusive=True, group="launch-preflight")
    async def preflight(self, req: LaunchRequest, key: bytes) -> None:
        """Pre-flight on the host; the result decides what the confirm button does."""
        progress = self.query_one("#launch-progress", ProgressLine)
        panel = self.query_one("#preflight", Static)
        self._button("Pre-flight running ...", disabled=True)
        progress.start(f"pre-flight on {req.host}", "GPUs, memory, holders, rendezvous port, disk, python, start")
        error: str | None = None
        result: PreflightResult | None = None
        try:
            result = await self.app.fleet.preflight(req.host, req.spec)  # type: ignore[attr-defined]
        except AgentError as exc:
            error = exc.message
        took = progress.finish("")
        if took >= 1:
            progress.update(Text(f"pre-flight took {took:.1f} s", style="dim"))
        self._checked = key
        self._result = result
        panel.update(preflight_text(result, error, req.host))
        panel.scroll_visible()
        if result is None:
            self._button("Launch anyway (ctrl+s)", variant="warning")
        elif result.ok:
            self._button("Launch (ctrl+s)", variant="success")
        elif only_holders_failed(result):
            self._button("Launch with --force (ctrl+s)", variant="error")
        else:
            self._button("Pre-flight failed", disabled=True, variant="error")

    @work(exclusive=True, group="launch-run")
    async def launch(self, req: LaunchRequest) -> None:
        """Launch what was confirmed; the dialog stays (with the error) if the agent refuses."""
        progress = self.query_one("#launch-progress", ProgressLine)
        self._button("Launching ...", disabled=True)
        progress.start(f"launching on {req.host}", "the agent records the spec, checks and starts the processes")
        try:
            reply = await self.app.fleet.launch(req.host, req.spec, request_id=self._request_id)  # type: ignore[attr-defined]
        except AgentError as exc:
            progress.finish(f"launch failed: {exc.message}", style="bold red")
            self.query_one("#launch-error", Static).update(Text(exc.message, style="bold red"))
            self._button("Launch (ctrl+s)")
            return
        progress.finish(f"{reply.run.id}: {reply.run.state}")
        self.dismiss(LaunchOutcome(req.host, reply.run, req.spec))

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "cancel":
            self.dismiss(None)
            return
        self.submit()

    def action_submit(self) -> None:
        self.submit()

    def action_cancel(self) -> None:
        if self.query_one("#launch-progress", ProgressLine).running and self._checked is not None:
            self.notify("the launch is on its way: wait for the agent's answer", severity="warning")
            return
        self.dismiss(None)
