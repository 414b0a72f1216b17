"""Provides pre-flight memory estimates: exact parameter counts from a model config, GPU memory per rank of a trainer run.

No torch here (the agent has none): parameters are counted analytically from a
transformers ``config.json`` (llama, mistral, qwen2, qwen3), and the memory of
an ``fsdp`` (``gpudeck.trainers.fsdp_lm``) or ``dflash`` (``gpudeck.trainers.dflash``) run is
worked out from its command line, read the way torchrun and the trainers read
it (:func:`parse_launch_argv`).

The memory model, per GPU (bytes; bf16 compute, as on every GPU run):

* FSDP2 shards fp32 weights, fp32 grads and AdamW's two fp32 moments over the
  ranks: 16 B/param / world. (With ``--grad-accum 1`` the grads do not exist
  during forward, so the measured peak is nearer 12 B/param: the estimate errs
  on the side of refusing.)
* Gathered bf16 parameters in flight: two decoder blocks (the current and the
  prefetched one) plus the lm_head group when parameters are resharded after
  forward (``--reshard-after-forward auto`` does it when world > 1), else the
  whole model.
* Activations saved for backward, per token per decoder layer, counted from what
  a transformers Llama/Qwen3 block keeps in eager mode (bf16): the two RMSNorms
  (fp32 upcast + bf16 output, 6H each), the q/k/v and MLP inputs (2H each), q,
  k, v, the attention output and the copy o_proj reads, with room for k/v
  repeated to every head where SDPA cannot do GQA (8·q_dim + 4·kv_dim), and the
  SwiGLU MLP's gate, up, silu and product (8·I):
  ``16·H + 8·q_dim + 4·kv_dim + 8·I`` bytes. Per-block ``torch.compile`` fuses
  the norms and the MLP and keeps about 0.65 of that (llama-1b on an H200:
  36.8 GiB compiled vs 50.8 GiB eager peak, bench/RESULTS.md).
  ``--activation-checkpointing`` keeps only each block's input (2H per token
  per layer) plus one block's activations while it is recomputed.
* Logits: B·T·vocab in bf16 plus the fp32 copy the loss works on (6 B each) when
  the loss is compiled (``--compile``); eager, backward starts with the logits,
  their fp32 copy, the fp32 log-softmax and its gradient and the bf16 gradient
  alive: 16 B each (Qwen3's 151,936-token vocabulary makes this the largest part).
* 0.6 GiB of CUDA context and allocator slack.

DFlash adds the frozen target in bf16 (no grads, no optimizer) and the selected
target hidden states it feeds the drafter, and trains the drafter with the same
16 B/param rule (its FSDP2 keeps gathered parameters from forward to backward).
Drafter activations are counted per block position (a full Qwen3 block:
``16·H + 12·q_dim + 8·I``) and per key/value position (context + block:
``2·H + 10·kv_dim``); with ``--attn sdpa`` also the dense mask (bool, plus a bf16
copy per layer) and k/v repeated to every head; and the chunked fused loss (one
fp32 chunk of logits). On the split topology the target ranks
and the drafter ranks are estimated separately and the larger is the need.

The figures are checked against measured H200 peaks in
tests/unit/test_estimate.py; an estimate is good to about +-30%.
"""

from __future__ import annotations

import argparse
import contextvars
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from gpudeck.agents.wire.errors import AgentError
from gpudeck.agents.wire.protocol import LaunchSpec, MemoryEstimate
from gpudeck.trainers.contract import PRESETS, TRAINER_MODULES, parse_index_list, trainer_args, trainer_module

GIB = 2**30
KNOWN_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

# bytes per parameter of what FSDP2 shards: fp32 weights + fp32 grads + AdamW m and v
SHARDED_STATE_BYTES = 16
# bytes per parameter of a checkpoint: fp32 weights + AdamW m and v (what gpudeck.trainers.common.checkpoint saves)
CHECKPOINT_BYTES_PER_PARAM = 12
# what per-block torch.compile keeps of the eager activations (calibrated: llama-1b, H200, bench/RESULTS.md)
COMPILED_ACTIVATION_RATIO = 0.65
# CUDA context, cuBLAS/NCCL workspaces and allocator slack
CUDA_SLACK_BYTES = int(0.6 * GIB)

# the trainers' defaults (trainers/common/runtime.py, trainers/fsdp_lm/trainer.py, trainers/dflash/trainer.py); a test keeps them in step
FSDP_DEFAULTS = {"batch_size": 8, "seq_len": 512}
DFLASH_DEFAULTS = {"batch_size": 2, "seq_len": 512, "drafter_layers": 1, "block_size": 16}

# transformers' defaults for keys a config.json may leave out (configuration_<type>.py, transformers 5)
_CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=None,
        head_dim=None,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
    ),
    "mistral": dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=None,
        tie_word_embeddings=False,
    ),
    "qwen2": dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=22016,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        head_dim=None,
        tie_word_embeddings=False,
    ),
    "qwen3": dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=22016,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        head_dim=128,
        tie_word_embeddings=False,
        attention_bias=False,
    ),
}


class EstimateError(AgentError):
    """The memory need of a run cannot be worked out; the message says why and how to launch anyway."""

    code = "estimate_failed"


class UnknownModelType(EstimateError):
    """The model config is of a type the parameter count does not know."""


# ----------------------------------------------------------------------------- parameters


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a decoder-only causal LM that its parameters and activations follow from."""

    model_type: str
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    qkv_bias: bool  # biases on q, k and v
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # qwen3: RMSNorm of head_dim on q and k

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """One decoder block: attention, SwiGLU MLP, two RMSNorms."""
        h, q, kv, i = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        attn = h * q + 2 * h * kv + q * h
        if self.qkv_bias:
            attn += q + 2 * kv
        if self.o_bias:
            attn += h
        if self.qk_norm:
            attn += 2 * self.head_dim
        mlp = 3 * h * i + ((2 * i + h) if self.mlp_bias else 0)
        return attn + mlp + 2 * h

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def lm_head_params(self) -> int:
        """The lm_head's own weight (0 when tied to the embedding)."""
        return 0 if self.tied else self.vocab * self.hidden

    @property
    def params(self) -> int:
        return self.embedding_params + self.layers * self.layer_params + self.hidden + self.lm_head_params


def model_shape(config: dict[str, Any]) -> ModelShape:
    """The shape of a transformers causal LM from its config dict (missing keys take transformers' defaults)."""
    model_type = config.get("model_type")
    if model_type not in _CONFIG_DEFAULTS:
        what = f"model_type {model_type!r}" if model_type else "a config without model_type"
        raise UnknownModelType(
            f"cannot count the parameters of {what}: the estimate knows {', '.join(KNOWN_MODEL_TYPES)}; "
            "give the GPU memory each GPU needs with --need-gib GIB to launch anyway"
        )
    # an explicit null means "derive it" for the kv heads and head_dim (as transformers does), "default" elsewhere
    derived = ("num_key_value_heads", "head_dim")
    c = {**_CONFIG_DEFAULTS[model_type], **{k: v for k, v in config.items() if v is not None or k in derived}}

    def num(key: str) -> int:
        value = c.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise EstimateError(f"{model_type} config: {key} is {value!r}, not a positive integer; fix the config or give --need-gib GIB")
        return value

    hidden, heads = num("hidden_size"), num("num_attention_heads")
    kv = c.get("num_key_value_heads") or heads
    head_dim = c.get("head_dim") or hidden // heads
    attention_bias = bool(c.get("attention_bias", False))
    return ModelShape(
        model_type=model_type,
        vocab=num("vocab_size"),
        hidden=hidden,
        intermediate=num("intermediate_size"),
        layers=num("num_hidden_layers"),
        heads=heads,
        kv_heads=int(kv),
        head_dim=int(head_dim),
        tied=bool(c.get("tie_word_embeddings", False)),
        # qwen2 always has q/k/v biases and none on o; mistral has none at all
        qkv_bias=True if model_type == "qwen2" else (attention_bias and model_type in ("llama", "qwen3")),
        o_bias=attention_bias and model_type in ("llama", "qwen3"),
        mlp_bias=bool(c.get("mlp_bias", False)) and model_type == "llama",
        qk_norm=model_type == "qwen3",
    )


def param_count(config: dict[str, Any]) -> int:
    """Exact parameter count of a transformers causal LM (llama, mistral, qwen2, qwen3) from its config dict."""
    return model_shape(config).params


def drafter_params(
    target: ModelShape, drafter_layers: int, drafter_config: dict[str, Any] | None = None, n_context_layers: int | None = None
) -> int:
    """Trainable parameters of a DFlash drafter on ``target`` (trainers/dflash/model.py's DFlashDraftModel).

    Qwen3-style blocks of the target's width and heads (q_norm/k_norm, no biases), a final norm,
    ``fc`` from the concatenated target layers (one per drafter layer, or the config's
    ``target_layer_ids``) to the hidden size, and its norm. A ``--drafter-config`` dict gives the
    blocks' heads and intermediate size.
    """
    block = _drafter_block(target, drafter_config)
    h = target.hidden
    n_ctx = n_context_layers if n_context_layers is not None else drafter_layers
    return drafter_layers * block.layer_params + h + n_ctx * h * h + h


def _drafter_block(target: ModelShape, drafter_config: dict[str, Any] | None = None) -> ModelShape:
    c = drafter_config or {}

    def pick(key: str, default: int) -> int:
        v = c.get(key)
        return int(v) if isinstance(v, int) and not isinstance(v, bool) and v > 0 else default

    return ModelShape(
        model_type="qwen3",
        vocab=target.vocab,
        hidden=target.hidden,
        intermediate=pick("intermediate_size", target.intermediate),
        layers=1,
        heads=pick("num_attention_heads", target.heads),
        kv_heads=pick("num_key_value_heads", target.kv_heads),
        head_dim=pick("head_dim", target.head_dim),
        tied=False,
        qkv_bias=False,
        o_bias=False,
        mlp_bias=False,
        qk_norm=True,
    )


# ----------------------------------------------------------------------------- command lines


@dataclass(frozen=True)
class LaunchArgv:
    """What a launch's argv says, read the way torchrun, python and the trainers would."""

    launcher: Literal["torchrun", "python", "other"]
    executable: str  # argv[0]
    python: str | None = None  # the interpreter when argv[0] is one (python -m torch.distributed.run counts)
    trainer: str | None = None  # "gpudeck.trainers.fsdp_lm" | "gpudeck.trainers.dflash" when the argv runs one
    trainer_args: tuple[str, ...] = ()
    nproc_per_node: str | None = None  # as given ("4", "gpu", "auto")
    nnodes: str | None = None  # as given ("2", "1:4")
    node_rank: int | None = None
    standalone: bool = False
    master_port: int | None = None  # --master-port / --master_port
    rdzv_endpoint: str | None = None  # --rdzv-endpoint host[:port]
    rdzv_backend: str = "static"  # torchrun's default
    # the trainer's own arguments, read once (from the declared table, trainers/contract.py's TRAINER_ARGS) with the argv;
    # None when it runs no trainer, or when they could not be read (``trainer_error`` says why)
    trainer_ns: argparse.Namespace | None = field(default=None, compare=False)
    trainer_error: str | None = None

    def trainer_options(self, trainer: str | None = None) -> argparse.Namespace:
        """The trainer's arguments as read with the argv (raises :class:`EstimateError` when they could not be read).

        ``trainer``: read as that trainer's instead (only when it is not the one the argv runs: no second read otherwise).
        """
        want = trainer or self.trainer
        if want is None:
            raise EstimateError("the launch runs no gpudeck trainer")
        if want == self.trainer:
            if self.trainer_error is not None:
                raise EstimateError(self.trainer_error)
            if self.trainer_ns is not None:
                return self.trainer_ns
        return parse_trainer_args(want, self.trainer_args)


# torchrun options that take a value (both spellings are accepted by torchrun)
_TORCHRUN_VALUE_OPTS = {
    "nnodes",
    "nproc-per-node",
    "rdzv-backend",
    "rdzv-endpoint",
    "rdzv-id",
    "rdzv-conf",
    "max-restarts",
    "monitor-interval",
    "start-method",
    "role",
    "node-rank",
    "master-addr",
    "master-port",
    "local-addr",
    "log-dir",
    "redirects",
    "tee",
    "local-ranks-filter",
    "logs-specs",
    "event-log-handler",
    "numa-binding",
    "signals-to-handle",
    "duplicate-stdout-filters",
    "duplicate-stderr-filters",
}
_TORCHRUN_SHORT_VALUE_OPTS = {"-r", "-t"}
_PYTHON_RE = re.compile(r"^python(\d+(\.\d+)?)?$")


def _is_python(exe: str) -> bool:
    return bool(_PYTHON_RE.match(os.path.basename(exe)))


def _trainer_of(module_or_script: str) -> str | None:
    return trainer_module(module_or_script)


def _parse_torchrun(rest: list[str]) -> tuple[dict[str, Any], str | None, list[str]]:
    """torchrun options, the script or module it runs, and that program's arguments."""
    opts: dict[str, Any] = {"standalone": False}
    i = 0
    while i < len(rest):
        tok = rest[i]
        if tok == "--":
            i += 1
            break
        if not tok.startswith("-") or tok == "-":
            break
        if tok in ("-m", "--module", "--no-python", "--no_python", "--run-path", "--run_path"):
            i += 1
            continue
        if tok == "--standalone":
            opts["standalone"] = True
            i += 1
            continue
        if tok in _TORCHRUN_SHORT_VALUE_OPTS:
            i += 2
            continue
        name, eq, value = tok[2:].partition("=")
        name = name.replace("_", "-")
        if name in _TORCHRUN_VALUE_OPTS:
            if not eq:
                value = rest[i + 1] if i + 1 < len(rest) else ""
                i += 1
            opts[name] = value
        i += 1
    if i >= len(rest):
        return opts, None, []
    return opts, rest[i], rest[i + 1 :]


def parse_launch_argv(argv: list[str]) -> LaunchArgv:
    """Read a launch argv: torchrun ..., python [-m torch.distributed.run ...] -m trainers.X ..., or anything else."""
    if not argv:
        raise EstimateError("the launch has no command")
    exe = argv[0]
    base = os.path.basename(exe)
    python: str | None = None
    torchrun_args: list[str] | None = None
    program: str | None = None
    program_args: list[str] = []
    if base == "torchrun":
        torchrun_args = argv[1:]
    elif _is_python(exe):
        python = exe
        rest = argv[1:]
        i = 0
        while i < len(rest):
            tok = rest[i]
            if tok in ("-X", "-W"):
                i += 2
                continue
            if tok == "-c":
                break
            if tok == "-m" or (tok.startswith("-m") and len(tok) > 2):
                module = rest[i + 1] if tok == "-m" and i + 1 < len(rest) else tok[2:]
                after = rest[i + 2 :] if tok == "-m" else rest[i + 1 :]
                if module in ("torch.distributed.run", "torch.distributed.launch"):
                    torchrun_args = after
                else:
                    program, program_args = module, after
                break
            if not tok.startswith("-"):
                program, program_args = tok, rest[i + 1 :]
                break
            i += 1
    opts: dict[str, Any] = {}
    if torchrun_args is not None:
        opts, program, program_args = _parse_torchrun(torchrun_args)
    trainer = _trainer_of(program) if program else None
    if trainer is None and torchrun_args is None and python is None:
        # a wrapper (env, nice, uv run, ...): look for `-m trainers.X` anywhere
        for j in range(1, len(argv) - 1):
            if argv[j] == "-m" and argv[j + 1] in TRAINER_MODULES.values():
                trainer, program_args = argv[j + 1], argv[j + 2 :]
                break
    master_port = opts.get("master-port")
    node_rank = opts.get("node-rank")
    trainer_ns: argparse.Namespace | None = None
    trainer_error: str | None = None
    if trainer:
        try:
            trainer_ns = parse_trainer_args(trainer, program_args)
        except EstimateError as exc:
            trainer_error = exc.message
    return LaunchArgv(
        launcher="torchrun" if torchrun_args is not None else ("python" if python else "other"),
        executable=exe,
        python=python,
        trainer=trainer,
        trainer_args=tuple(program_args) if trainer else (),
        nproc_per_node=opts.get("nproc-per-node"),
        nnodes=opts.get("nnodes"),
        node_rank=int(node_rank) if node_rank and str(node_rank).isdigit() else None,
        standalone=bool(opts.get("standalone")),
        master_port=int(master_port) if master_port and str(master_port).isdigit() else None,
        rdzv_endpoint=opts.get("rdzv-endpoint") or None,
        rdzv_backend=opts.get("rdzv-backend") or "static",
        trainer_ns=trainer_ns,
        trainer_error=trainer_error,
    )


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting (the agent must not exit on a bad argv)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise EstimateError(message)


def _trainer_parser(trainer: str) -> argparse.ArgumentParser:
    """The options of trainers/common/runtime.py, fsdp_lm.py and dflash.py that shape memory and starts.

    Built from the declared table (:data:`gpudeck.trainers.contract.TRAINER_ARGS`): every option that takes a
    value is declared, so a value is never mistaken for something else; tests/unit/test_estimate.py
    compares this parser with the trainers' own.
    """
    p = _Parser(add_help=False, allow_abbrev=True)
    for a in trainer_args(trainer):
        if a.takes == "flag":
            p.add_argument(a.flag, action="store_true")
        else:
            p.add_argument(a.flag, type=int if a.takes == "int" else str, default=a.default)
    return p


def parse_trainer_args(trainer: str, args: list[str] | tuple[str, ...]) -> argparse.Namespace:
    """The trainer's arguments as a namespace (unknown ones are ignored; the trainer itself judges them)."""
    ns, _ = _trainer_parser(trainer).parse_known_args(list(args))
    return ns


def parse_rank_list(text: str) -> list[int]:
    """'0,1' / '0-1' / '2' -> sorted unique ranks (the trainers' own rule, from gpudeck.trainers.presets)."""
    try:
        return parse_index_list(text)
    except ValueError:
        raise EstimateError(f"rank list {text!r} is not like 0,1 or 0-3") from None


def _first_int(text: str | None) -> int | None:
    """'4' -> 4, '1:4' -> 1 (elastic min: the fewest ranks, the most memory each); anything else -> None."""
    if text is None:
        return None
    head = str(text).split(":")[0].strip()
    return int(head) if head.isdigit() and int(head) > 0 else None


def world_size_of(spec: LaunchSpec, parsed: LaunchArgv) -> tuple[int, str]:
    """The job's world size and where it came from.

    torchrun: ``--nproc-per-node`` (``gpu``/``auto``: the GPUs given with --gpus; absent: torchrun's
    default, 1) times ``--nnodes`` (the elastic minimum) or the spec's nnodes. A plain process is one
    rank, whatever GPUs it may see. Fewer ranks means more memory each, so unknowns count as 1.
    """
    if parsed.launcher != "torchrun":
        return 1, "one process, no torchrun"
    nproc = _first_int(parsed.nproc_per_node)
    if nproc is not None:
        where = f"--nproc-per-node {nproc}"
    elif parsed.nproc_per_node in ("gpu", "auto") and spec.gpus:
        nproc, where = len(spec.gpus), f"--nproc-per-node {parsed.nproc_per_node}: {len(spec.gpus)} GPUs given"
    else:
        nproc, where = 1, f"--nproc-per-node {parsed.nproc_per_node or '1 (torchrun default)'}: taken as 1"
    nnodes = _first_int(parsed.nnodes) or spec.nnodes or 1
    if nnodes > 1:
        where += f" x {nnodes} nodes"
    return nproc * nnodes, "torchrun " + where


# ----------------------------------------------------------------------------- configs


MAX_CONFIG_BYTES = 16 << 20  # a model config is a few KiB; a bigger file is not one
MAX_CONFIG_DEPTH = 32  # transformers' configs nest two or three levels
MAX_CONFIG_INT = 1 << 53  # any real size, count or id fits; past it the arithmetic is meaningless
_READ: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("estimate_files_read", default=None)


def _check_config_value(value: Any, depth: int = 0) -> str | None:
    """Why a decoded config value is out of the estimate's limits (nesting, integer size, non-finite numbers), or None."""
    if depth > MAX_CONFIG_DEPTH:
        return f"it nests deeper than {MAX_CONFIG_DEPTH} levels"
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return None
    if isinstance(value, int):
        return None if -MAX_CONFIG_INT <= value <= MAX_CONFIG_INT else f"the number {str(value)[:20]}... is out of range (|n| <= 2**53)"
    if isinstance(value, float):
        return None if math.isfinite(value) else "a number is not finite or has more than 20 digits"
    items = value.values() if isinstance(value, dict) else value
    for v in items:
        why = _check_config_value(v, depth + 1)
        if why is not None:
            return why
    return None


def _read_json(path: Path, what: str) -> dict[str, Any]:
    """A config file as a dict within the limits above; EstimateError naming the file otherwise (never a traceback)."""
    read = _READ.get()
    if read is not None:
        read.append(str(path))
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            raise EstimateError(f"{what}: {path} is over {MAX_CONFIG_BYTES >> 20} MiB, not a model config; give --need-gib GIB")
        # parse_constant: NaN/Infinity are refused; parse_int: a 10**5000 literal fails fast instead of costing the
        # quadratic int conversion
        data = json.loads(
            raw.decode("utf-8"),
            parse_constant=lambda c: (_ for _ in ()).throw(ValueError(f"{c} is not a number JSON allows")),
            parse_int=lambda t: int(t) if len(t) <= 20 else float("inf"),
        )
    except OSError as exc:
        raise EstimateError(f"{what}: cannot read {path} ({exc.strerror or exc}); fix the path or give --need-gib GIB") from None
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise EstimateError(f"{what}: {path} is not valid JSON ({str(exc)[:200]}); fix it or give --need-gib GIB") from None
    if not isinstance(data, dict):
        raise EstimateError(f"{what}: {path} does not hold a JSON object; give --need-gib GIB")
    why = _check_config_value(data)
    if why is not None:
        raise EstimateError(f"{what}: {path} cannot be a model config: {why}; fix it or give --need-gib GIB")
    return data


def resolve_model_config(
    spec_text: str | None, init_from: str | None, cwd: Path, option: str = "--model-config"
) -> tuple[dict[str, Any], str]:
    """The config dict the trainer would build and a description ("llama-1b preset", "config /x/config.json")."""
    if init_from is not None:
        folder = _resolve(init_from, cwd)
        return _read_json(folder / "config.json", f"--init-from {init_from}"), f"--init-from {init_from}"
    if spec_text is None:
        spec_text = "tiny"  # gpudeck.trainers.fsdp_lm's default
    if spec_text in PRESETS:
        return dict(PRESETS[spec_text]), f"{spec_text} preset"
    path = _resolve(spec_text, cwd)
    if path.is_dir():
        path = path / "config.json"
    elif not path.is_file():
        raise EstimateError(
            f"{option} {spec_text!r}: not a preset ({', '.join(PRESETS)}) and no such file or folder on this host; "
            "fix it or give --need-gib GIB"
        )
    return _read_json(path, f"{option} {spec_text}"), f"config {path}"


def _resolve(path_text: str, cwd: Path) -> Path:
    p = Path(path_text).expanduser()
    return p if p.is_absolute() else cwd / p


# ----------------------------------------------------------------------------- memory


def activation_bytes_per_token_layer(shape: ModelShape, compiled: bool, elem: int = 2) -> float:
    """Bytes one decoder block keeps for backward per token (see the module docstring)."""
    eager = (16 * shape.hidden + 8 * shape.q_dim + 4 * shape.kv_dim + 8 * shape.intermediate) * elem / 2
    return eager * COMPILED_ACTIVATION_RATIO if compiled else eager


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def _sum_parts(parts: dict[str, int]) -> int:
    return sum(parts.values())


def _elem(dtype: str | None) -> int:
    # auto is bf16 on a GPU, which is where the estimate is used
    return 4 if dtype == "fp32" else 2


def estimate_fsdp(parsed: LaunchArgv, world: int, world_note: str, cwd: Path) -> MemoryEstimate:
    """Per-GPU memory of a gpudeck.trainers.fsdp_lm run."""
    a = parsed.trainer_options(TRAINER_MODULES["fsdp"])
    if a.model_config is not None and a.init_from is not None:
        raise EstimateError("give --model-config or --init-from, not both (gpudeck.trainers.fsdp_lm refuses both)")
    config, source = resolve_model_config(a.model_config, a.init_from, cwd)
    shape = model_shape(config)
    n = shape.params
    elem = _elem(a.dtype)
    b, t = a.batch_size, a.seq_len
    tokens = b * t
    rafw = a.reshard_after_forward == "yes" or (a.reshard_after_forward == "auto" and world > 1)
    in_flight = (2 * shape.layer_params + (shape.lm_head_params or shape.embedding_params)) * elem if rafw else n * elem
    per_layer = activation_bytes_per_token_layer(shape, a.compile, elem)
    if a.activation_checkpointing:
        act = tokens * (shape.layers * shape.hidden * elem + per_layer)
        act_note = f"activation checkpointing: block inputs of {shape.layers} layers + one block recomputed"
    else:
        act = tokens * shape.layers * per_layer
        act_note = f"{shape.layers} layers, {'compiled' if a.compile else 'eager'}"
    compiled_loss = a.compile_loss == "yes" or (a.compile_loss == "auto" and a.compile)
    # compiled, the loss keeps the logits and fuses the fp32 work; eager, when backward starts the
    # logits, their fp32 copy, the fp32 log-softmax, its fp32 gradient and the logits' gradient all live
    per_logit = elem + 4 if compiled_loss else elem + 4 + 4 + 4 + elem
    parts = {
        "weights_grads_adamw": SHARDED_STATE_BYTES * n // world,
        "params_in_flight": int(in_flight),
        "activations": int(act),
        "logits": tokens * shape.vocab * per_logit,
        "cuda_context": CUDA_SLACK_BYTES,
    }
    total = _sum_parts(parts)
    method = (
        f"{source} ({shape.model_type}): {n:,} params; {SHARDED_STATE_BYTES} B/param (fp32 weights, grads, AdamW) "
        f"/ {world} rank{'s' if world != 1 else ''} ({world_note}) = {_gib(parts['weights_grads_adamw'])} "
        f"+ gathered {'bf16' if elem == 2 else 'fp32'} params {_gib(in_flight)} ({'2 blocks + head' if rafw else 'whole model, not resharded'}) "
        f"+ activations B={b} T={t} ({act_note}) {_gib(act)} + logits ({per_logit} B each, "
        f"{'compiled' if compiled_loss else 'eager'} loss) {_gib(parts['logits'])} "
        f"+ CUDA context {_gib(CUDA_SLACK_BYTES)} = {_gib(total)} per GPU; an estimate, +-30%"
    )
    return MemoryEstimate(per_gpu_bytes=total, params=n, method=method, parts=parts)


def _dflash_target(a: argparse.Namespace, cwd: Path) -> tuple[dict[str, Any], str]:
    target_config = a.target_config if a.target_config is not None else a.model_config
    if (a.target is None) == (target_config is None):
        raise EstimateError(
            "give exactly one of --target PATH or --target-config/--model-config (gpudeck.trainers.dflash refuses otherwise)"
        )
    if a.target is not None:
        return resolve_model_config(None, a.target, cwd)[0], f"target {a.target}"
    config, source = resolve_model_config(target_config, None, cwd, option="--target-config")
    return config, f"target {source}"


def _dflash_shape_args(a: argparse.Namespace, cwd: Path) -> tuple[int, int, dict[str, Any] | None]:
    """Drafter layers, block size and the --drafter-config dict: as given, else the saved drafter's
    (--init-from) or the config file's, else the defaults."""
    layers, block = a.drafter_layers, a.block_size
    dcfg = None
    if a.drafter_config is not None:
        dcfg = _read_json(_resolve(a.drafter_config, cwd), f"--drafter-config {a.drafter_config}")
        types = dcfg.get("layer_types")
        n = dcfg.get("num_hidden_layers", len(types) if isinstance(types, list) else None)
        layers = layers if layers is not None else n
        block = block if block is not None else dcfg.get("block_size")
    if a.init_from is not None and (layers is None or block is None):
        saved = _read_json(_resolve(a.init_from, cwd) / "config.json", f"--init-from {a.init_from}")
        dcfg = saved
        layers = layers if layers is not None else saved.get("num_hidden_layers")
        block = block if block is not None else saved.get("block_size")
    layers = layers if isinstance(layers, int) else DFLASH_DEFAULTS["drafter_layers"]
    block = block if isinstance(block, int) else DFLASH_DEFAULTS["block_size"]
    return layers, block, dcfg


def _largest(parts: dict[str, int]) -> str:
    name = max(parts, key=lambda k: parts[k])
    return f"largest part: {name.replace('_', ' ')} {_gib(parts[name])}"


def estimate_dflash(parsed: LaunchArgv, world: int, world_note: str, cwd: Path) -> MemoryEstimate:
    """Per-GPU memory of a gpudeck.trainers.dflash run (colocated, or the larger side of split).

    ``parts`` are the four the question asks about — ``weights`` (the frozen target, or a
    split drafter rank's embedding and lm_head, plus the drafter's gathered bf16 parameters),
    ``optimizer`` (the drafter's fp32 weights, gradients and AdamW moments, sharded),
    ``activations`` (what the drafter keeps for backward, its masks, the target features) and
    ``lm_head_chunk`` (the chunked lm_head + cross-entropy) — and the CUDA context; ``method``
    names the largest and breaks each down.
    """
    a = parsed.trainer_options(TRAINER_MODULES["dflash"])
    config, source = _dflash_target(a, cwd)
    t_shape = model_shape(config)
    n_target = t_shape.params
    d_layers, block, dcfg = _dflash_shape_args(a, cwd)
    ids = ((dcfg or {}).get("dflash_config") or {}).get("target_layer_ids")
    n_ctx = len(ids) if isinstance(ids, list) and ids else d_layers
    n_drafter = drafter_params(t_shape, d_layers, dcfg, n_ctx)
    d_block = _drafter_block(t_shape, dcfg)
    types = (dcfg or {}).get("layer_types") or []
    sliding = "sliding_attention" in types
    elem = _elem(a.dtype)
    t = a.seq_len
    # a token budget packs budget // seq_len full-length records (the batch the budget allows at worst)
    b = max(1, a.token_budget // t) if a.token_budget else a.batch_size
    anchors = min(a.num_anchors, t)
    q_per_seq = anchors * block  # block positions the drafter runs per sequence
    q_pos = b * q_per_seq
    kv_pos = b * (t + q_per_seq)
    h = t_shape.hidden
    per_q = (16 * h + 12 * d_block.q_dim + 8 * d_block.intermediate) * elem / 2
    per_kv = (2 * h + 10 * d_block.kv_dim) * elem / 2
    ratio = COMPILED_ACTIVATION_RATIO if a.compile else 1.0
    act = d_layers * (q_pos * per_q + kv_pos * per_kv) * ratio + q_pos * h * elem  # + the block tokens' embeddings
    attn = a.attn
    if attn == "auto":
        attn = "flex"  # on CUDA
    mask = 0
    if attn == "sdpa":
        # the dense bool mask (1 B; a second one for the sliding layers), its bf16 additive copy per layer,
        # and k/v repeated to all heads (SDPA without GQA)
        mask = b * q_per_seq * (t + q_per_seq) * ((2 if sliding else 1) + 2 * d_layers)
        mask += d_layers * kv_pos * 2 * (d_block.q_dim - d_block.kv_dim) * elem
    if a.loss_mode == "plain":
        loss = q_pos * t_shape.vocab * 12
    elif a.loss_mode == "recompute":
        loss = a.loss_chunk_rows * t_shape.vocab * 10
    else:
        loss = a.loss_chunk_rows * t_shape.vocab * 4 + q_pos * h * 4
    features = b * t * n_ctx * h * elem
    shape_note = (
        f"{d_layers}-layer drafter"
        + (f" ({types.count('sliding_attention')} sliding, window {(dcfg or {}).get('sliding_window')})" if sliding else "")
        + f", {n_drafter:,} params"
    )

    if a.topology == "split":
        if not a.target_ranks or not a.drafter_ranks:
            raise EstimateError("--topology split needs --target-ranks and --drafter-ranks")
        n_d = len(parse_rank_list(a.drafter_ranks))
        hidden_states = b * t * (t_shape.layers + 1) * h * elem
        target_side = {
            "weights": n_target * elem,
            "optimizer": 0,
            # the base model keeps every layer's hidden states (output_hidden_states) while it runs
            "activations": hidden_states + a.queue_depth * features,
            "lm_head_chunk": 0,
            "cuda_context": CUDA_SLACK_BYTES,
        }
        head = t_shape.embedding_params + t_shape.lm_head_params
        drafter_side = {
            "weights": head * elem + n_drafter * elem,
            "optimizer": SHARDED_STATE_BYTES * n_drafter // max(1, n_d),
            "activations": int(act + mask + a.queue_depth * features),
            "lm_head_chunk": int(loss),
            "cuda_context": CUDA_SLACK_BYTES,
        }
        t_total, d_total = _sum_parts(target_side), _sum_parts(drafter_side)
        parts = drafter_side if d_total >= t_total else target_side
        total = max(t_total, d_total)
        side = "drafter" if d_total >= t_total else "target"
        method = (
            f"dflash split, {source} ({t_shape.model_type}, {n_target:,} params, frozen) and a {shape_note}: "
            f"target ranks need {_gib(t_total)} (weights {_gib(target_side['weights'])} + hidden states B={b} T={t} "
            f"{_gib(hidden_states)}), drafter ranks need {_gib(d_total)} (weights: embedding + lm_head "
            f"{_gib(head * elem)} + gathered drafter {_gib(n_drafter * elem)}; optimizer {SHARDED_STATE_BYTES} B/param / "
            f"{n_d} drafter rank{'s' if n_d != 1 else ''} {_gib(drafter_side['optimizer'])}; activations {anchors} anchors "
            f"x block {block} {_gib(act + mask)} + queued features {_gib(a.queue_depth * features)}; lm_head chunk "
            f"{_gib(loss)}); the {side} side is the need, {_gib(total)} per GPU, {_largest(parts)}; an estimate, +-30%"
        )
        return MemoryEstimate(per_gpu_bytes=total, params=n_drafter, method=method, parts={k: int(v) for k, v in parts.items()})

    parts = {
        "weights": n_target * elem + n_drafter * elem,
        "optimizer": SHARDED_STATE_BYTES * n_drafter // world,
        "activations": int(act + mask + features),
        "lm_head_chunk": int(loss),
        "cuda_context": CUDA_SLACK_BYTES,
    }
    total = _sum_parts(parts)
    method = (
        f"dflash colocated, {source} ({t_shape.model_type}): weights: {n_target:,} target params frozen in "
        f"{'bf16' if elem == 2 else 'fp32'} {_gib(n_target * elem)} + the gathered {shape_note} {_gib(n_drafter * elem)}; "
        f"optimizer {SHARDED_STATE_BYTES} B/param / {world} rank{'s' if world != 1 else ''} ({world_note}) "
        f"{_gib(parts['optimizer'])}; activations B={b} T={t} {anchors} anchors x block {block} "
        f"({'compiled' if a.compile else 'eager'}, {attn} attention) {_gib(act + mask)} + target features {_gib(features)}; "
        f"{a.loss_mode} lm_head chunk {_gib(loss)}; CUDA context {_gib(CUDA_SLACK_BYTES)} = {_gib(total)} per GPU, "
        f"{_largest(parts)}; an estimate, +-30%"
    )
    return MemoryEstimate(per_gpu_bytes=total, params=n_drafter, method=method, parts=parts)


def estimate(spec: LaunchSpec, world_size: int | None = None, parsed: LaunchArgv | None = None) -> MemoryEstimate | None:
    """GPU memory each GPU of the run needs: from ``--need-gib``, or estimated for fsdp/dflash; None for a plain command.

    Raises :class:`EstimateError` (or :class:`UnknownModelType`) when a trainer run's need cannot be
    worked out; the message says why and that ``--need-gib`` launches anyway.
    """
    if spec.need_gib is not None:
        if spec.need_gib < 0:
            raise EstimateError(f"--need-gib {spec.need_gib} is negative; give the GiB each GPU needs")
        return MemoryEstimate(per_gpu_bytes=int(spec.need_gib * GIB), method="given with --need-gib")
    if spec.kind not in TRAINER_MODULES:
        return None
    if parsed is None:  # a caller without the launch's one parse (the agent passes its LaunchPlan's)
        parsed = parse_launch_argv(spec.argv)
    want = TRAINER_MODULES[spec.kind]
    if parsed.trainer != want:
        found = f"it runs {parsed.trainer}" if parsed.trainer else "it does not run a gpudeck trainer"
        raise EstimateError(
            f"a {spec.kind} launch runs `python -m {want}` (or torchrun ... -m {want}), but {found}: "
            f"fix the kind or the command, or give --need-gib GIB"
        )
    if world_size is not None:
        world, note = world_size, "given"
    else:
        world, note = world_size_of(spec, parsed)
    cwd = Path(spec.cwd or os.getcwd())
    read: list[str] = []
    token = _READ.set(read)
    try:
        if spec.kind == "fsdp":
            return estimate_fsdp(parsed, world, note, cwd)
        return estimate_dflash(parsed, world, note, cwd)
    except EstimateError as exc:
        if read and not any(f in exc.message for f in read):
            raise type(exc)(f"{exc.message} (read from {', '.join(read)})") from None
        raise
    except (TypeError, ValueError, AttributeError, KeyError, IndexError, ArithmeticError, RecursionError) as exc:
        # a config of the right shape with values of the wrong type or size (a list where a count goes, a head
        # count of 10**15): the arithmetic refuses it; the operator learns which file, not a traceback
        files = ", ".join(read) or "the trainer's arguments"
        raise EstimateError(
            f"cannot estimate the GPU memory from {files}: a value has the wrong type or size ({type(exc).__name__}: "
            f"{str(exc)[:200]}); fix it or give --need-gib GIB"
        ) from None
    finally:
        _READ.reset(token)


def estimate_or_reason(
    spec: LaunchSpec, world_size: int | None = None, parsed: LaunchArgv | None = None
) -> tuple[MemoryEstimate | None, str | None]:
    """:func:`estimate`, with an :class:`EstimateError` turned into its message (for pre-flight to report)."""
    try:
        return estimate(spec, world_size, parsed), None
    except EstimateError as exc:
        return None, exc.message
