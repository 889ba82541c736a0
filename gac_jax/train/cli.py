"""The ``gac-jax`` command: train, evaluate, list presets, show a resolved config, plot a run.

    gac-jax train --config demo --set rollout.lag=8 gac.monitor_only=true --out runs/lag8
    gac-jax eval --checkpoint runs/lag8/checkpoints/50
    gac-jax presets
    gac-jax show-config --config countdown_sync --set steps=10
    gac-jax show-config --config my_run.yaml
    gac-jax plot runs/lag8 --out runs/lag8/metrics.png
    gac-jax plan --config qwen3_0_6b_gsm8k --fake-devices 8
    gac-jax export-hf runs/lag8 --step 100 --out runs/lag8/hf

The command is thin: configs come from `gac_jax.train.config_io`, runs from
`gac_jax.train.loop`. A bad config (unknown key, ill-typed value, failed validation) prints
the message and exits with status 2, as argparse does for bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from gac_jax.train.config import PRESET_DESCRIPTIONS, preset_names
from gac_jax.train.config_io import RESUMABLE_FIELDS, apply_overrides, load_config, to_yaml

CONFIG_FILE = "config.json"  # Written into the run directory by `loop.train`.
BAD_INPUT_EXIT = 2  # A bad config, argument, checkpoint or data file (argparse's code).
DISK_EXIT = 74  # The output cannot be written: no space, read-only (sysexits' EX_IOERR).


def _fail(parser: argparse.ArgumentParser, message: str, code: int = BAD_INPUT_EXIT):
    """Ends the command with one line on stderr, ``gac-jax CMD: error: MESSAGE``, and exit
    status `code` (no usage block: the message says what to change)."""
    message = " ".join(str(message).split())  # One line, whatever the error held.
    print(f"{parser.prog}: error: {message}", file=sys.stderr)
    raise SystemExit(code)


@contextlib.contextmanager
def _failing(parser: argparse.ArgumentParser, errors=ValueError):
    """`_fail` with the message of any of `errors` raised inside."""
    try:
        yield
    except errors as error:
        _fail(parser, str(error))


def _progress(command: str):
    """Says on stderr, a line each, what a long command (`plan`, `eval`) does as it goes."""
    return lambda text: print(f"{command}: {text}", file=sys.stderr, flush=True)


def _resolve(parser: argparse.ArgumentParser, config: str, overrides: Sequence[str]):
    with _failing(parser):
        return apply_overrides(load_config(config), overrides)


def _resume_config(parser, out_dir: Path, overrides: Sequence[str], resumable):
    """The run's own config with `overrides`, which may only touch `resumable` fields;
    each change is named on stderr."""
    from gac_jax.train.config_io import config_diff

    saved = out_dir / CONFIG_FILE
    if not saved.is_file():
        _fail(parser, f"--resume: {str(saved)!r} does not exist; is {str(out_dir)!r} a run?")
    base = _resolve(parser, str(saved), [])
    config = _resolve(parser, str(saved), overrides)
    for key, old, new in config_diff(base, config):
        if key.split(".")[0] not in resumable:
            _fail(
                parser,
                f"--resume: {key} may not change on resume (only {', '.join(resumable)} may).",
            )
        print(f"resume: {key} {old!r} -> {new!r}", file=sys.stderr)
    return config


def _missing_task_data(config, command: str) -> bool:
    """Prints one line and returns True when the run's task data is not on this machine.

    Checked before the loop starts: offline, tfds would otherwise retry GSM8K's download
    for minutes before failing. The CLI never downloads GSM8K (README, "GSM8K data").
    """
    if config.task != "gsm8k":
        return False
    from gac_jax.tasks.gsm8k import require_gsm8k_offline

    try:
        require_gsm8k_offline(config.data_dir)
    except FileNotFoundError as error:
        print(f"gac-jax {command}: error: {error}", file=sys.stderr)
        return True
    return False


def _cmd_train(args, parser) -> int:
    if args.resume and args.config is not None:
        _fail(parser, "--resume continues the run's own config.json: drop --config.")
    if args.resume and args.out is None:
        _fail(parser, "--resume needs --out, the run directory to continue.")
    name = args.config or "demo"
    out_dir = Path(args.out) if args.out is not None else Path("runs") / Path(name).stem
    from gac_jax.train import processes

    with _failing(parser):
        processes.initialize(args.coordinator, args.num_processes, args.process_id)
    # Imported when a run starts, not with the CLI: `presets` and `show-config` stay fast,
    # and tests can put a fake loop (and run module, for `eval`) in sys.modules.
    loop = importlib.import_module("gac_jax.train.loop")
    if args.resume:
        config = _resume_config(parser, out_dir, args.set, RESUMABLE_FIELDS)
    else:
        config = _resolve(parser, name, args.set)
    if _missing_task_data(config, "train"):
        return 2
    try:
        loop.train(config, out_dir, resume=args.resume, overwrite=args.overwrite)
    except (loop.RunExistsError, ValueError, FileNotFoundError) as error:
        _fail(parser, str(error))
    except TimeoutError as error:  # Before OSError, its base class.
        why = "the rollout workers made nothing in that time; is the reward hanging"
        _fail(parser, f"no batch: {error} (buffer.take_timeout): {why} (reward_guard.timeout)?", 1)
    except loop.InterruptedAtOnce:  # Asked twice: stopped at once, without a checkpoint.
        _fail(parser, "interrupted twice: stopped without saving this step", 128 + 2)
    except KeyboardInterrupt:  # Once, before the steps (no handler of the run's yet).
        _fail(parser, "interrupted during start-up: stopped before the first step", 128 + 2)
    except OSError as error:  # The disk: full, read-only, not ours. Said: where and why.
        where = f"under {out_dir}" if error.filename is None else error.filename
        _fail(parser, f"cannot write {where}: {error.strerror or error}", DISK_EXIT)
    except loop.RunInterrupted as stopped:
        print(stopped, file=sys.stderr)
        return stopped.exit_code
    except (FloatingPointError, RuntimeError) as error:
        print(f"gac-jax train: error: {error}", file=sys.stderr)
        return 1
    print(f"Run written to {out_dir}: {out_dir / 'metrics.jsonl'}, plot {out_dir / 'plot.png'}")
    return 0


def _json_value(value):
    from gac_jax.train.metrics import to_json_scalar

    try:
        return to_json_scalar(value)
    except TypeError:
        return str(value)


def _checkpoint_config(args, parser, checkpoint: Path):
    """`--config`, or else the config.json of the run `checkpoint` belongs to (in it or the
    two directories above: run/checkpoints/<step>/...), with `--set`."""
    if not checkpoint.exists():  # Said before the data, the model or a warm start is built.
        _fail(parser, f"{checkpoint} does not exist: a run directory or one of its checkpoints.")
    if args.config is not None:
        return _resolve(parser, args.config, args.set)
    for directory in (checkpoint, *list(checkpoint.parents)[:2]):
        if (directory / CONFIG_FILE).is_file():
            return _resolve(parser, str(directory / CONFIG_FILE), args.set)
    _fail(
        parser,
        f"no {CONFIG_FILE} found in {checkpoint} or the two directories above it; pass --config.",
    )


def _cmd_export_hf(args, parser) -> int:
    checkpoint = Path(args.run)
    config = _checkpoint_config(args, parser, checkpoint)
    with _failing(parser, (ValueError, FileNotFoundError)):
        from gac_jax.train.export import export_checkpoint

        out = export_checkpoint(config, checkpoint, args.out, step=args.step, dtype=args.dtype)
    print(out)
    return 0


def _cmd_eval(args, parser) -> int:
    checkpoint = Path(args.checkpoint)
    config = _checkpoint_config(args, parser, checkpoint)
    if _missing_task_data(config, "eval"):
        return 2
    with _failing(parser, (ValueError, FileNotFoundError)):
        run = importlib.import_module("gac_jax.train.run")  # As `loop` in `_cmd_train`.
        progress = _progress("eval")
        metrics = run.evaluate_checkpoint(config, checkpoint, step=args.step, progress=progress)
    print(json.dumps({k: _json_value(v) for k, v in dict(metrics).items()}, indent=2))
    return 0


def _cmd_presets(args, parser) -> int:
    width = max(map(len, preset_names()))
    for name in preset_names():
        print(f"{name:<{width}}  {PRESET_DESCRIPTIONS[name]}")
    return 0


def _cmd_show_config(args, parser) -> int:
    print(to_yaml(_resolve(parser, args.config, args.set)), end="")
    return 0


def _cmd_plan(args, parser) -> int:
    progress = _progress("plan")
    progress("starting JAX and the library (each compile is named as it starts)")
    from gac_jax.train.plan import plan, with_cheap_cpu_compiles

    os.environ["XLA_FLAGS"] = with_cheap_cpu_compiles(os.environ.get("XLA_FLAGS", ""))
    if args.fake_devices:
        import jax

        try:
            jax.config.update("jax_num_cpu_devices", args.fake_devices)
            jax.config.update("jax_platforms", "cpu")
        except RuntimeError as error:  # The backend is already up.
            _fail(parser, f"--fake-devices {args.fake_devices}: {error}")
    config = _resolve(parser, args.config, args.set)
    with _failing(parser):
        report = plan(config, args.device_memory_gib, args.extrapolate, progress)
    print(json.dumps(report, indent=2))
    print(report["verdict"], file=sys.stderr)
    return 0 if report["fits"] else 1


def _cmd_plot(args, parser) -> int:
    from gac_jax.train import plots

    with _failing(parser, (ValueError, FileNotFoundError)):
        smoothing = plots.smoothing_weight(args.smooth)
        if len(args.runs) == 1:  # Its title and GAC's levels from the run's config.json.
            run = Path(args.runs[0])
            directory = run if run.is_dir() else run.parent
            out, keys = args.out or directory / "plot.png", args.key or plots.DEFAULT_KEYS
            path = plots.plot_run(run, out, keys, smoothing=smoothing, title=directory.name)
        else:
            runs, keys = plots.run_labels(args.runs), args.key or plots.COMPARE_KEYS
            path = plots.plot_runs(runs, args.out or "compare.png", keys, smoothing=smoothing)
    print(path)
    return 0


def _cmd_demo(args, parser) -> int:
    from gac_jax.lab.demo import run_demo  # The one command over the laboratory's sweeps.

    with _failing(parser, (ValueError, FileNotFoundError)):
        try:
            result = run_demo(args.out, seed=args.seed, jobs=args.jobs, overrides=args.set)
        except RuntimeError as error:  # A run failed: its process's log says why.
            print(f"gac-jax demo: error: {error}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:  # The runs stop at their step's end, as `train` does.
            _fail(parser, "interrupted; the same command resumes the runs", 128 + 2)
    runs = ", ".join(map(str, result.runs.values()))
    print(f"{result.line}\nplot: {result.plot} (in {result.seconds:.0f} s; runs: {runs})")
    return 0


def _add_config_args(p: argparse.ArgumentParser, *, default: str | None, shown: str | None = None):
    shown = f" (default: {shown or default})" if shown or default else ""
    presets = f"a preset ({', '.join(preset_names())}) or a YAML/JSON config file{shown}"
    p.add_argument("--config", default=default, metavar="NAME_OR_PATH", help=presets)
    example = "override a field by dotted name, e.g. rollout.lag=8 optimizer.clip_norm=none ess={}"
    many = dict(action="extend", nargs="+", default=[], metavar="KEY=VALUE")
    p.add_argument("--set", **many, help=example)


def _add_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", metavar="DIR", help="run directory (default: runs/<config name>)")
    resume = "continue the run in --out from its last checkpoint, with its own config (--set "
    resume += "may change steps and the evaluation and checkpoint cadence)"
    p.add_argument("--resume", action="store_true", help=resume)
    p.add_argument("--overwrite", action="store_true", help="delete a run already in --out")
    g = p.add_argument_group("several learner processes (jax.distributed; each runs this command)")
    address = "process 0's address (or $GAC_JAX_COORDINATOR)"
    g.add_argument("--coordinator", metavar="HOST:PORT", help=address)
    count = "learner processes in all (or $GAC_JAX_NUM_PROCESSES); -1 lets jax.distributed "
    count += "detect the cluster (SLURM, Open MPI, Kubernetes, TPU pods)"
    g.add_argument("--num-processes", type=int, metavar="P", help=count)
    which = "this process, 0..P-1 (or $GAC_JAX_PROCESS_ID)"
    g.add_argument("--process-id", type=int, metavar="I", help=which)


def _add_checkpoint_commands(sub) -> None:
    """`eval` and `export-hf`: commands that read a run's checkpoint."""
    p = sub.add_parser(
        "eval",
        help="evaluate a checkpoint on held-out problems",
        description="Evaluate a checkpoint on held-out problems and print the metrics as JSON "
        "(pass@1, pass@k, greedy accuracy), with the draws the run's own evaluation of that "
        "step used.",
    )
    where = "a run directory, its checkpoints/ directory, or one step's directory"
    p.add_argument("--checkpoint", required=True, metavar="DIR", help=where)
    p.add_argument("--step", type=int, help="the step to evaluate (default: the newest)")
    _add_config_args(p, default=None)

    p = sub.add_parser(
        "export-hf",
        help="write a checkpoint's policy as a Hugging Face model directory",
        description="Write a checkpoint's policy as a Hugging Face model directory "
        "(config.json and safetensors, a LoRA run's weights merged), with the tokenizer files "
        "of the run's init directory, as transformers loads them.",
    )
    p.add_argument("run", metavar="RUN", help="a run directory, its checkpoints/ or one step's")
    p.add_argument("--step", type=int, help="the step to export (default: the newest)")
    p.add_argument("--out", required=True, metavar="DIR", help="the model directory to write")
    p.add_argument("--dtype", help="store the weights in this dtype (default: the params')")
    _add_config_args(p, default=None)


def _add_plot_and_demo(sub) -> None:
    """`plot` and `demo`: commands that show runs."""
    from gac_jax.train import plots

    p = sub.add_parser(
        "plot",
        help="plot a run's metrics, or compare runs",
        description="Plot one run (a panel per metric) or compare several (a panel per "
        "metric, a line per run); held-out metrics (eval/...) are drawn point by point.",
        epilog="example: gac-jax plot runs/demo/naive/seed0 runs/demo/vcpo/seed0 "
        "--key eval/pass@1 --key reward --smooth 10",
    )
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directory or metrics.jsonl")
    keys = f"{' '.join(plots.DEFAULT_KEYS)}; of several runs: {' '.join(plots.COMPARE_KEYS)}"
    p.add_argument("--key", action="append", help=f"a metric, a panel each (default: {keys})")
    smooth = "the training metrics' moving-average window (default 10; 1: none)"
    p.add_argument("--smooth", type=float, default=10.0, metavar="STEPS", help=smooth)
    p.add_argument("--out", metavar="PNG", help="default: RUN/plot.png or compare.png")
    p = sub.add_parser(
        "demo",
        help="stale rollouts break training, a cure holds: two runs side by side (~3 min)",
        description="Train one small cell twice side by side, naively on stale rollouts "
        "and with VCPO, plot them with held-out pass@1 from step 0 and print the "
        "comparison (gac_jax.lab.demo). Finished runs in --out are kept, not retrained.",
    )
    p.add_argument("--out", default="runs/demo", metavar="DIR", help="default: runs/demo")
    p.add_argument("--seed", type=int, default=0, help="default: 0")
    p.add_argument("--jobs", type=int, default=2, help="processes, one XLA thread each (2)")
    p.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="on every run")


def build_parser() -> argparse.ArgumentParser:
    from gac_jax import __version__

    parser = argparse.ArgumentParser(
        prog="gac-jax", description="Stable asynchronous RL of language models in JAX."
    )
    parser.add_argument("--version", action="version", version=f"gac-jax {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "train",
        help="train a policy",
        description="Train a policy with GRPO: a preset or a config file, fields changed with "
        "--set. Without --config the run is the embedded default, the `demo` preset "
        "(countdown from the shipped warm start, asynchronous GRPO with GAC).",
        epilog="example: gac-jax train --config countdown_sync --set steps=50 --out runs/try",
    )
    _add_config_args(p, default=None, shown="demo")
    _add_train_args(p)

    _add_checkpoint_commands(sub)

    sub.add_parser("presets", help="list the config presets")
    p = sub.add_parser("show-config", help="print the resolved config as YAML")
    _add_config_args(p, default="demo")

    p = sub.add_parser(
        "plan",
        help="compile the learner step and sampler from abstract arrays: will it fit?",
        description="Will a run fit? Build the run `train` would build with abstract arrays "
        "(no weights are made or loaded), compile its learner step and its sampler, and "
        "print each program's memory per device (arguments, outputs, temporaries, peak) and "
        "FLOPs as JSON, then a one-line verdict against --device-memory-gib. Each compile is "
        "named on stderr as it starts, with its time when done. Exit status 1 when a "
        "program does not fit.",
        epilog="example: gac-jax plan --config qwen3_0_6b_gsm8k --fake-devices 8",
    )
    _add_config_args(p, default="demo")
    memory = "memory of one device to check against (default 80)"
    p.add_argument("--device-memory-gib", type=float, default=80.0, help=memory)
    fake = "plan on N fake CPU devices (the mesh a pod would have), not the local ones"
    p.add_argument("--fake-devices", type=int, metavar="N", help=fake)
    probes = "compile the learner step at 2, 3 and 4 layers and extend the line to the model's "
    probes += "(checked on the third; about a quarter of the time); the sampler whole"
    p.add_argument("--extrapolate", action="store_true", help=probes)
    _add_plot_and_demo(sub)
    for name, p in sub.choices.items():  # `gac-jax NAME` runs `_cmd_NAME(args, its parser)`.
        p.set_defaults(func=globals()[f"_cmd_{name.replace('-', '_')}"], parser=p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``gac-jax`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    # Errors are reported by the subcommand's parser, so the usage shown is the relevant one.
    return args.func(args, args.parser)


if __name__ == "__main__":
    sys.exit(main())
