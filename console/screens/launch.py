"""Provides the Launch dialog: host, GPUs (with free memory and holders), kind, arguments, explicit start."""

from __future__ import annotations

import shlex
import sys

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Select, Static

from agents.protocol import LaunchSpec
from console.fmt import gib

TRAINER_MODULES = {"fsdp": "trainers.fsdp_lm", "dflash": "trainers.dflash"}


class LaunchRequest:
    """What the dialog returns: the host and the spec to launch."""

    def __init__(self, host: str, spec: LaunchSpec) -> None:
        self.host = host
        self.spec = spec


def prefill_from(spec: LaunchSpec) -> dict[str, str]:
    """The form's fields for relaunching ``spec``: the same run, with the start left for the operator."""
    argv = list(spec.argv)
    python = sys.executable
    if spec.kind in TRAINER_MODULES and len(argv) >= 3 and argv[1:3] == ["-m", TRAINER_MODULES[spec.kind]]:
        python, argv = argv[0], argv[3:]
        cleaned: list[str] = []
        skip = False
        for a in argv:  # the old start never carries over: fresh or resume is chosen again
            if skip:
                skip = False
                continue
            if a == "--fresh":
                continue
            if a == "--resume":
                skip = True
                continue
            cleaned.append(a)
        argv = cleaned
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
        argv = [python or sys.executable, "-m", TRAINER_MODULES[kind], *argv]
    elif not argv:
        raise ValueError("command: give the command to run, e.g. python train.py --lr 3e-4")
    return LaunchSpec(argv=argv, name=name.strip() or None, kind=kind, gpus=gpu_list, start=start_value)  # type: ignore[arg-type]


class LaunchDialog(ModalScreen[LaunchRequest | None]):
    """The launch form."""

    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("ctrl+s", "submit", "Launch")]

    def __init__(self, prefill: LaunchSpec | None = None, parent: str | None = None, host: str | None = None) -> None:
        super().__init__()
        self._prefill = prefill_from(prefill) if prefill is not None else {}
        self._parent_run = parent
        self._first_host = host

    def on_mount(self) -> None:
        for field in ("args", "name", "gpus", "python"):
            if field in self._prefill:
                self.query_one(f"#{field}", Input).value = self._prefill[field]
        if "kind" in self._prefill:
            self.query_one("#kind", Select).value = self._prefill["kind"]

    def compose(self) -> ComposeResult:
        fleet_status = self.app.fleet_status()  # type: ignore[attr-defined]
        hosts = list(fleet_status)
        if self._first_host in hosts:
            hosts.remove(self._first_host)
            hosts.insert(0, self._first_host)
        with Vertical(classes="dialog", id="launch-dialog"):
            title = f"Relaunch {self._parent_run}: choose the start again" if self._parent_run else "Launch a run"
            yield Static(f"{title}  (ctrl+s launches, esc cancels)", classes="dialog-title")
            with Horizontal(classes="field"):
                yield Label("Host")
                yield Select([(h, h) for h in hosts], value=hosts[0], id="host", allow_blank=False)
            yield Static(self._gpu_hint(hosts[0]), id="gpu-hint", classes="hint")
            with Horizontal(classes="field"):
                yield Label("GPUs")
                yield Input(id="gpus", placeholder="0,1 (empty: leave CUDA_VISIBLE_DEVICES alone)")
            with Horizontal(classes="field"):
                yield Label("Kind")
                yield Select([("command", "command"), ("fsdp (trainers.fsdp_lm)", "fsdp"), ("dflash (trainers.dflash)", "dflash")], value="command", id="kind", allow_blank=False)
            with Horizontal(classes="field"):
                yield Label("Arguments")
                yield Input(id="args", placeholder="python train.py --lr 3e-4  (for trainers: their options)")
            with Horizontal(classes="field"):
                yield Label("Name")
                yield Input(id="name", placeholder="optional")
            with Horizontal(classes="field"):
                yield Label("Start")
                yield Select([("fresh: step 0, new checkpoints", "fresh"), ("resume at step N", "resume")], id="start", prompt="trainers: choose fresh or resume (no default)")
                yield Input(id="resume-step", placeholder="N", classes="narrow")
            with Horizontal(classes="field"):
                yield Label("Python")
                yield Input(id="python", value=sys.executable)
            yield Static("", id="launch-error", classes="error")
            with Horizontal(classes="dialog-buttons"):
                yield Button("Launch", variant="primary", id="launch")
                yield Button("Cancel", id="cancel")

    def _gpu_hint(self, host: str) -> Text:
        st = self.app.fleet_status().get(host)  # type: ignore[attr-defined]
        if st is None or st.snapshot is None:
            return Text("no snapshot yet", style="dim")
        snap = st.snapshot
        if not snap.gpus:
            return Text(f"no GPUs on {host}: {snap.gpu_error}", style="dim")
        t = Text()
        for g in snap.gpus:
            free = g.memory_total - g.memory_used
            holders = ", ".join(f"{p.pid} {p.attribution.lower()} {gib(p.used_bytes)}G" for p in g.processes) or "free"
            t.append(f"GPU {g.index}: {gib(free)} GiB free — {holders}\n", style="red" if any(p.attribution in ("STALE", "FOREIGN") for p in g.processes) else "")
        return t

    def on_select_changed(self, event: Select.Changed) -> None:
        if event.select.id == "host" and event.value != Select.NULL:
            self.query_one("#gpu-hint", Static).update(self._gpu_hint(str(event.value)))

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "cancel":
            self.dismiss(None)
            return
        self.submit()

    def submit(self) -> None:
        """Validate the form and return the request, or show what to fix."""
        val = lambda wid: self.query_one(f"#{wid}", Input).value  # noqa: E731
        start = self.query_one("#start", Select).value
        try:
            spec = build_spec(
                kind=str(self.query_one("#kind", Select).value),
                args=val("args"),
                name=val("name"),
                gpus=val("gpus"),
                start="" if start == Select.NULL else str(start),
                resume_step=val("resume-step"),
                python=val("python"),
            )
        except ValueError as exc:
            self.query_one("#launch-error", Static).update(Text(str(exc), style="bold red"))
            return
        spec.parent = self._parent_run
        self.dismiss(LaunchRequest(str(self.query_one("#host", Select).value), spec))

    def action_submit(self) -> None:
        self.submit()

    def action_cancel(self) -> None:
        self.dismiss(None)
