"""Tests of the gac-jax command, with a fake training loop."""

import json
import signal
import sys
import types

import pytest
import yaml

from gac_jax.train import plots
from gac_jax.train.cli import main
from gac_jax.train.config import get_preset, preset_names
from gac_jax.train.config_io import RESUMABLE_FIELDS, apply_overrides, save_config
from gac_jax.train.loop import InterruptedAtOnce, RunInterrupted
from gac_jax.train.metrics import MetricWriter


@pytest.fixture
def fake_loop(monkeypatch):
    calls = []
    fake = types.ModuleType("gac_jax.train.loop")

    class RunExistsError(ValueError):
        pass

    def train(config, out_dir, resume=False, overwrite=False):
        calls.append(("train", config, out_dir, resume))
        if out_dir.name == "taken" and not (resume or overwrite):
            raise RunExistsError(f"{str(out_dir)!r} already holds a run")
        if out_dir.name == "preempted":
            raise RunInterrupted(out_dir, 7, signal.SIGTERM)
        if out_dir.name == "ctrl-c-once":  # Before the run's handlers: Python's own.
            raise KeyboardInterrupt
        if out_dir.name == "ctrl-c-twice":
            raise InterruptedAtOnce

    def evaluate_checkpoint(config, checkpoint_dir, step=None, progress=None):
        calls.append(("eval", config, checkpoint_dir))
        progress("sampling")
        return {"pass@8": 0.5, "reward": float("nan")}

    fake.RunExistsError = RunExistsError
    fake.RunInterrupted = RunInterrupted
    fake.InterruptedAtOnce = InterruptedAtOnce
    fake.RESUMABLE_FIELDS = RESUMABLE_FIELDS
    fake.train = train
    fake_run = types.ModuleType("gac_jax.train.run")
    fake_run.evaluate_checkpoint = evaluate_checkpoint
    monkeypatch.setitem(sys.modules, "gac_jax.train.loop", fake)
    monkeypatch.setitem(sys.modules, "gac_jax.train.run", fake_run)
    return calls


def test_train_passes_config_and_out_dir(fake_loop, tmp_path, capsys):
    out = tmp_path / "run"
    status = main(
        [
            "train",
            "--config",
            "countdown_sync",
            "--set",
            "rollout.lag=3",
            "gac.monitor_only=false",
            "--set",
            "steps=5",
            "--out",
            str(out),
        ]
    )
    assert status == 0
    [(kind, config, out_dir, resume)] = fake_loop
    expected = apply_overrides(
        get_preset("countdown_sync"), ["rollout.lag=3", "gac.monitor_only=false", "steps=5"]
    )
    assert (kind, config, out_dir, resume) == ("train", expected, out, False)
    assert str(out) in capsys.readouterr().out


def test_train_into_an_existing_run_is_a_usage_error(fake_loop, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--out", str(tmp_path / "taken")])
    assert exit_info.value.code == 2
    assert "already holds a run" in capsys.readouterr().err
    assert main(["train", "--out", str(tmp_path / "taken"), "--overwrite"]) == 0


def test_resume_continues_the_runs_own_config(fake_loop, tmp_path, capsys):
    run = tmp_path / "run"
    save_config(get_preset("countdown_lagged8"), run / "config.json")
    assert main(["train", "--out", str(run), "--resume", "--set", "steps=400"]) == 0
    [(_, config, out_dir, resume)] = fake_loop
    assert config == apply_overrides(get_preset("countdown_lagged8"), ["steps=400"])
    assert (out_dir, resume) == (run, True)
    assert "resume: steps 100 -> 400" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--set", "rollout.lag=2"], "--resume: rollout.lag may not change on resume (only "),
        (["--config", "demo"], "--resume continues the run's own config.json: drop --config."),
    ],
)
def test_resume_refuses_what_may_not_change(fake_loop, tmp_path, capsys, argv, message):
    run = tmp_path / "run"
    save_config(get_preset("countdown_lagged8"), run / "config.json")
    with pytest.raises(SystemExit) as e:
        main(["train", "--out", str(run), "--resume", *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert fake_loop == []


def test_resume_of_a_directory_without_a_run(fake_loop, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--out", str(tmp_path / "empty"), "--resume"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "config.json' does not exist; is" in err


def test_an_interrupted_run_says_how_to_resume_and_exits_with_the_signal(
    fake_loop, tmp_path, capsys
):
    status = main(["train", "--out", str(tmp_path / "preempted")])
    assert status == 128 + signal.SIGTERM
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"SIGTERM: stopped after step 7 and saved a checkpoint; resume with `gac-jax train "
        f"--out {tmp_path / 'preempted'} --resume`."
    ]


@pytest.mark.parametrize(
    ("out", "said"),
    [
        ("ctrl-c-once", "interrupted during start-up: stopped before the first step"),
        ("ctrl-c-twice", "interrupted twice: stopped without saving this step"),
    ],
)
def test_ctrl_c_says_whether_it_came_once_in_start_up_or_twice(
    fake_loop, tmp_path, capsys, out, said
):
    with pytest.raises(SystemExit) as stop:
        main(["train", "--out", str(tmp_path / out)])
    assert stop.value.code == 128 + signal.SIGINT
    assert capsys.readouterr().err.strip().splitlines() == [f"gac-jax train: error: {said}"]


@pytest.mark.parametrize("command", ["eval --checkpoint", "export-hf"])
def test_a_checkpoint_that_is_not_there_is_said_before_anything_is_built(
    fake_loop, tmp_path, capsys, command
):
    missing = tmp_path / "runs" / "q06"
    with pytest.raises(SystemExit) as stop:
        main([*command.split(), str(missing), *(["--out", "x"] if command == "export-hf" else [])])
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(err) == 1
    assert f"{missing} does not exist: a run directory or one of its checkpoints" in err[0]
    assert not [call for call in fake_loop if call[0] == "eval"]


def test_train_defaults(fake_loop, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train"]) == 0
    [(_, config, out_dir, resume)] = fake_loop
    assert config == get_preset("demo") and not resume
    assert str(out_dir) == "runs/demo"


def test_train_from_a_json_file(fake_loop, tmp_path):
    path = tmp_path / "exp.json"
    path.write_text(json.dumps({"base": "countdown_lagged8", "seed": 3}))
    main(["train", "--config", str(path), "--out", str(tmp_path / "o")])
    config = fake_loop[0][1]
    assert config.seed == 3 and config.rollout.lag == 8


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["train", "--set", "rollout.lagg=3"], "rollout.lagg"),
        (["train", "--set", "gac.skip=maybe"], "'maybe'"),
        (["train", "--set", "steps"], "Override 'steps' is not of the form key=value"),
        (["show-config", "--set", "optimizer.learning_rate=-1"], "optimizer.learning_rate=-1"),
        (
            ["show-config", "--set", "loss.policy_loss=tb", "--set", "learner.mini_batches=2"],
            "partition function",
        ),
        (["train", "--config", "nosuch"], "'nosuch'"),
        (["show-config", "--set", "gac.tau_low=0.9"], "gac.tau_low=0.9"),
    ],
)
def test_config_errors_exit_2_without_traceback(fake_loop, tmp_path, capsys, argv, needle):
    with pytest.raises(SystemExit) as e:
        main([*argv, *(["--out", str(tmp_path)] if argv[0] == "train" else [])])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and "error:" in err and "Traceback" not in err
    assert fake_loop == []


def test_eval_with_config_and_without(fake_loop, tmp_path, capsys):
    ckpt = tmp_path / "run" / "checkpoints" / "50"
    ckpt.mkdir(parents=True)
    assert (
        main(
            [
                "eval",
                "--checkpoint",
                str(ckpt),
                "--config",
                "countdown_sync",
                "--set",
                "eval_size=4",
            ]
        )
        == 0
    )
    kind, config, checkpoint_dir = fake_loop[-1]
    assert kind == "eval" and checkpoint_dir == ckpt
    assert config == apply_overrides(get_preset("countdown_sync"), ["eval_size=4"])
    printed = json.loads(capsys.readouterr().out)
    assert printed == {"pass@8": 0.5, "reward": "nan"}

    # Without --config, the config the run saved is used.
    with pytest.raises(SystemExit) as e:
        main(["eval", "--checkpoint", str(ckpt)])
    assert e.value.code == 2 and "--config" in capsys.readouterr().err
    save_config(get_preset("countdown_lagged8"), tmp_path / "run" / "config.json")
    main(["eval", "--checkpoint", str(ckpt), "--set", "seed=9"])
    assert fake_loop[-1][1] == apply_overrides(get_preset("countdown_lagged8"), ["seed=9"])


def test_presets_and_show_config(capsys):
    assert main(["presets"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == preset_names()
    assert all(len(line.split()) > 3 for line in lines)  # Each with its description.
    assert (
        main(
            [
                "show-config",
                "--config",
                "demo",
                "--set",
                "optimizer.clip_norm=none",
                "loss.policy_loss=m2po",
                "loss.loss_kwargs.tau_m2=0.04",
            ]
        )
        == 0
    )
    d = yaml.safe_load(capsys.readouterr().out)
    assert d["optimizer"]["clip_norm"] is None
    assert d["loss"]["loss_kwargs"] == {"tau_m2": 0.04}
    assert d["rollout"]["mode"] == get_preset("demo").rollout.mode


def test_plot(tmp_path, capsys, monkeypatch):
    for name in ("a", "b"):
        with MetricWriter(tmp_path / name, tensorboard=False) as writer:
            for step in range(5):
                writer.write(step, {"reward": step / 5, "loss": 1.0})
    assert main(["plot", str(tmp_path / "a")]) == 0
    assert (tmp_path / "a" / "plot.png").read_bytes()[:4] == b"\x89PNG"
    drawn = []
    monkeypatch.setattr(plots, "plot_run", lambda *a, **k: drawn.append((a, k)) or tmp_path / "p")
    monkeypatch.setattr(plots, "plot_runs", lambda *a, **k: drawn.append((a, k)) or tmp_path / "p")
    assert main(["plot", str(tmp_path / "a"), "--smooth", "4"]) == 0
    (run, _, keys), kwargs = drawn[-1]
    assert keys == plots.DEFAULT_KEYS and kwargs == {"smoothing": 0.75, "title": "a"}
    argv = ["plot", str(tmp_path / "a"), str(tmp_path / "b" / "metrics.jsonl")]
    assert main([*argv, "--key", "reward", "--key", "loss", "--smooth", "1"]) == 0
    (runs, out, keys), kwargs = drawn[-1]
    assert list(runs) == ["a", "b"] and str(out) == "compare.png"
    assert keys == ["reward", "loss"] and kwargs == {"smoothing": 0.0}
    monkeypatch.undo()
    out = tmp_path / "cmp.png"
    assert main([*argv, "--key", "reward", "--key", "loss", "--out", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"
    capsys.readouterr()
    for bad, message in (
        (["--key", "nosuch"], "nosuch"),
        (["--smooth", "0"], "smooth=0.0 must be a window of at least 1 step"),
    ):
        with pytest.raises(SystemExit) as e:
            main(["plot", str(tmp_path / "a"), *bad])
        assert e.value.code == 2 and message in capsys.readouterr().err


def test_demo(tmp_path, capsys, monkeypatch):
    from gac_jax.lab import demo

    calls = []

    def fake_run_demo(out, **kwargs):
        calls.append((out, kwargs))
        if kwargs["seed"] == 9:
            raise RuntimeError("sweep shards exited with codes [1, 0]. See x/process*.log.")
        runs = {"naive": tmp_path / "n", "VCPO": tmp_path / "v"}
        return demo.DemoResult("held-out pass@1 ...", tmp_path / "demo.png", runs, 151.2)

    monkeypatch.setattr(demo, "run_demo", fake_run_demo)
    assert main(["demo", "--set", "steps=2", "eval_every=1"]) == 0
    assert calls[-1] == (
        "runs/demo",
        {"seed": 0, "jobs": 2, "overrides": ["steps=2", "eval_every=1"]},
    )
    assert capsys.readouterr().out.splitlines() == [
        "held-out pass@1 ...",
        f"plot: {tmp_path / 'demo.png'} (in 151 s; runs: {tmp_path / 'n'}, {tmp_path / 'v'})",
    ]
    assert main(["demo", "--out", str(tmp_path), "--seed", "9", "--jobs", "1"]) == 1
    assert calls[-1][1]["jobs"] == 1
    assert capsys.readouterr().err.strip() == (
        "gac-jax demo: error: sweep shards exited with codes [1, 0]. See x/process*.log."
    )


def test_version_and_the_help_a_first_run_reads(capsys):
    from gac_jax import __version__

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"gac-jax {__version__}"
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "(default: demo)" in help_text and "example: gac-jax train" in help_text
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    assert "JSON" in capsys.readouterr().out


@pytest.mark.parametrize(("command", "says"), [("plan", "Will a run fit?"), ("export-hf", "LoRA")])
def test_plan_and_export_help_describe_the_command(capsys, command, says):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    usage, description, *_ = capsys.readouterr().out.split("\n\n")
    assert usage.startswith(f"usage: gac-jax {command}") and says in description
