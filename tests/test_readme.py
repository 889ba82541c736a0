"""The README runs as written.

Its Python blocks run here. Each of its command blocks (```bash) has one runner in
`RUNNERS`, keyed by the block's first command: the blocks that train or plan run in the
tests of their area (tests/train/test_readme_commands.py, test_own_task.py,
test_multiturn.py, test_real_model_readme.py, each shrinking the runs with `--set`), the
others here: `make`'s targets dry-run, a plot of two runs, the GSM8K fetch with the hub
answered locally, and the blocks marked as needing a GPU, the network or a Ray cluster
checked for syntax and arguments. The README's size, commit hashes, links, `task=jsonl:`
paths, inline shell commands and `examples/` are checked too.
"""

import ast
import json
import pathlib
import re
import runpy
import shlex
import shutil
import subprocess
import sys

import pytest

from gac_jax.train.cli import build_parser, main
from gac_jax.train.metrics import read_metrics

REPO = pathlib.Path(__file__).resolve().parents[1]
README = REPO / "README.md"
FENCED = re.compile(r"```(\w*)\n(.*?)```", re.S)
HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b")

# A command block's first command -> the test that runs it (file::function, or files).
README_COMMANDS = "tests/train/test_readme_commands.py::"
REAL_MODEL = "tests/train/test_real_model_readme.py::test_the_real_model_section_runs_step_by_step"
RUNNERS = {
    "make demo": "tests/test_readme.py::test_the_install_block",
    ".venv/bin/gac-jax presets": README_COMMANDS + "test_the_quick_tours_commands_run",
    ".venv/bin/gac-jax train --config countdown_sync --out runs/sync": (
        "tests/test_readme.py::test_the_plot_block"
    ),
    ".venv/bin/gac-jax train --config countdown_sync --set": (
        "tests/train/test_own_task.py::test_the_readme_commands_run"
    ),
    ".venv/bin/gac-jax train --config calculator": (
        "tests/train/test_multiturn.py::test_the_readmes_multiturn_commands_run"
    ),
    "pip install -e .": "tests/test_readme.py::test_the_gpu_install_block",
    "hf download": "tests/test_readme.py::test_the_weights_block",
    "mkdir -p ~/tensorflow_datasets": "tests/test_readme.py::test_the_gsm8k_block",
    "gac-jax plan": REAL_MODEL,
    "gac-jax train --config qwen3_0_6b_gsm8k_1gpu": REAL_MODEL,
    ".venv/bin/gac-jax train --config demo --out runs/shared": (
        README_COMMANDS + "test_the_scaling_out_layouts_on_one_host_run"
    ),
    ".venv/bin/gac-jax train --config qwen3_0_6b_gsm8k --set": (
        README_COMMANDS + "test_the_scaling_out_layouts_on_one_host_run"
    ),
    # Its two halves run in these files; here its syntax and arguments.
    "ray start --head": "tests/test_readme.py::test_the_ray_block "
    "tests/train/test_multihost_loop.py tests/train/test_async_backends.py",
}


def _text() -> str:
    return README.read_text()


def _blocks(language: str) -> list[str]:
    return [body for lang, body in FENCED.findall(_text()) if lang == language]


def _first_command(block: str) -> str:
    return next(line for line in block.splitlines() if line.strip() and line[0] != "#")


def _bash_block(key: str) -> str:
    (block,) = [b for b in _blocks("bash") if _first_command(b).startswith(key)]
    return block


def _commands(block: str) -> list[list[str]]:
    """The block's commands as argv (continuations joined, comments dropped)."""
    lines = re.sub(r"\\\n\s*", " ", block).splitlines()
    return [words for line in lines if (words := shlex.split(line, comments=True))]


def _bash_syntax_ok(script: str) -> bool:
    checked = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    return checked.returncode == 0


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(markdown: str) -> set[str]:
    prose = FENCED.sub("", markdown)
    return {_slug(h) for h in re.findall(r"^#{1,6} (.+)$", prose, re.M)}


def test_readme_python_blocks_run(capsys):
    blocks = _blocks("python")
    assert blocks, "README.md has no ```python example"
    for block in blocks:
        exec(compile(block, str(README), "exec"), {})
    printed = capsys.readouterr().out
    assert printed.strip(), "the README example prints its statistics"


def test_every_command_block_has_one_runner_and_parses():
    blocks = _blocks("bash")
    used = set()
    for block in blocks:
        first = _first_command(block)
        keys = [k for k in RUNNERS if first.startswith(k)]
        assert len(keys) == 1, f"README block starting {first!r}: runners {keys}"
        used.add(keys[0])
        assert _bash_syntax_ok(block), block
    assert used == set(RUNNERS), f"runners of no block: {set(RUNNERS) - used}"
    for runner in RUNNERS.values():
        for target in runner.split():
            path, _, function = target.partition("::")
            source = (REPO / path).read_text()
            assert not function or f"def {function}(" in source, target


def test_the_readme_is_short_and_names_few_commits():
    text = _text()
    assert len(text.splitlines()) <= 450
    hashes = HASH.findall(FENCED.sub("", text))
    assert len(hashes) <= 3, hashes
    assert "make demo" in text and "make test" in text


def test_the_commit_hash_pattern_finds_hashes():
    assert HASH.findall("at commit b371f34, 2026-11-28; 0a0b8da and 8bde32e") == [
        "b371f34",
        "0a0b8da",
        "8bde32e",
    ]
    assert HASH.findall("1024 tokens, deadbeef, 12345678, a sha256 of ffff") == []


def test_every_jsonl_task_path_is_in_the_repository():
    paths = []
    for spec in re.findall(r"jsonl:([\w./,-]+)", _text()):
        paths += [p for p in spec.split(",") if p and not p.isupper() and "_PATH" not in p]
    assert paths, "the README names no JSONL file"
    for path in paths:
        assert (REPO / path).is_file(), path


def test_inline_commands_parse_in_the_shell():
    starts = ("--set ", "gac-jax ", ".venv/bin/", "pip install", "python ", "PYTHONPATH=")
    spans = [s.replace("\n", " ") for s in re.findall(r"`([^`]+)`", FENCED.sub("", _text()))]
    commands = [s for s in spans if s.startswith(starts)]
    assert "--set 'generation.stop=</answer>'" in commands
    for command in commands:
        assert _bash_syntax_ok(command), command
    assert not _bash_syntax_ok("--set generation.stop=</answer>")  # What the check catches.


def test_links_and_anchors_resolve():
    text = _text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith("http"):
            continue
        path, _, anchor = target.partition("#")
        document = (REPO / path) if path else README
        assert document.exists(), target
        if anchor:
            assert anchor in _anchors(document.read_text()), target


def test_the_install_block(tmp_path):
    targets = [words[1] for words in _commands(_bash_block("make demo"))]
    assert targets == ["demo", "test"]
    for target in targets:  # Dry runs: what each would do, nothing run or installed.
        done = subprocess.run(
            ["make", "-n", "-C", str(REPO), target], capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        assert ("gac-jax" if target == "demo" else "pytest") in done.stdout


@pytest.mark.slow
def test_the_plot_block(tmp_path, monkeypatch, capsys):
    from tests.train.test_readme_commands import SHRINK

    train, plot = _commands(_bash_block(".venv/bin/gac-jax train --config countdown_sync --out"))
    assert train[0].endswith("gac-jax") and plot[:2] == [train[0], "plot"]
    monkeypatch.chdir(tmp_path)
    assert main([*train[1:], "--set", *SHRINK]) == 0
    runs = [pathlib.Path(w) for w in plot[2:] if w.startswith("runs/") and not w.endswith(".png")]
    assert [r.name for r in runs] == ["sync", "vcpo_lag8"]
    shutil.copytree(runs[0], runs[1])  # Section 4's run, made in its own test.
    assert "eval/pass@1" in read_metrics(runs[0] / "metrics.jsonl")[-1]
    capsys.readouterr()
    assert main(plot[1:]) == 0
    out = pathlib.Path(plot[plot.index("--out") + 1])
    assert pathlib.Path(capsys.readouterr().out.strip()) == out
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_gpu_install_block():
    (command,) = _commands(_bash_block("pip install -e ."))
    (pin,) = [w for w in command if w.startswith("jax[")]
    extra, version = re.fullmatch(r"jax\[cuda(\d+)\]==([\d.]+)", pin).groups()
    measured = (REPO / "benchmarks/ACCELERATOR.md").read_text()  # What the figures ran on.
    assert f"JAX {version} (CUDA {extra} plugin)" in measured
    assert f"JAX {version} with its CUDA {extra} plugin" in _text()


def test_the_weights_block():
    (command,) = _commands(_bash_block("hf download"))
    hf = pathlib.Path(sys.executable).parent / "hf"
    if not hf.exists():
        pytest.skip("no hf command in this environment (huggingface_hub)")
    done = subprocess.run([str(hf), *command[1:2], "--help"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    for option in (w for w in command if w.startswith("--")):
        assert option in done.stdout, option


def test_the_gsm8k_block(tmp_path):
    """The block as written under a HOME of its own, `datasets.load_dataset` answered from
    local rows (sitecustomize) instead of the hub: the files it writes are GSM8K's rows."""
    from tests.train.test_gsm8k_offline import TEST, TRAIN

    pytest.importorskip("datasets")
    block = _bash_block("mkdir -p ~/tensorflow_datasets")
    hub = tmp_path / "hub"
    hub.mkdir()
    (hub / "rows.json").write_text(json.dumps({"train": TRAIN, "test": TEST}))
    (hub / "sitecustomize.py").write_text(
        "import json, pathlib, datasets\n"
        "ROWS = json.loads((pathlib.Path(__file__).parent / 'rows.json').read_text())\n"
        "def load_dataset(path, name=None, split=None):\n"
        "    assert (path, name) == ('openai/gsm8k', 'main'), (path, name)\n"
        "    return datasets.Dataset.from_list(ROWS[split])\n"
        "datasets.load_dataset = load_dataset\n"
    )
    home = tmp_path / "home"
    home.mkdir()
    env = {
        "HOME": str(home),
        "PATH": f"{pathlib.Path(sys.executable).parent}:/usr/bin:/bin",
        "PYTHONPATH": str(hub),
    }
    done = subprocess.run(
        ["bash", "-e", "-c", block], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    manual = home / "tensorflow_datasets" / "downloads" / "manual"
    for split, rows in (("train", TRAIN), ("test", TEST)):
        lines = (manual / f"{split}.jsonl").read_text().splitlines()
        assert [json.loads(line) for line in lines] == rows, split


def test_the_ray_block(capsys):
    """Needs a Ray cluster and several hosts: its arguments are the CLI's, its config valid."""
    commands = _commands(_bash_block("ray start --head"))
    assert commands[0][:2] == ["ray", "start"]
    (argv,) = [c for c in commands if "gac-jax" in c]
    argv = argv[argv.index("gac-jax") + 1 :]
    argv = ["0" if w == "$i" else w for w in argv]
    args = build_parser().parse_args(argv)
    assert args.command == "train" and args.num_processes == 2
    config = argv[argv.index("--config") + 1]
    sets = argv[argv.index("--set") + 1 : argv.index("--coordinator")]
    assert "init=/path/to/Qwen3-1.7B" in sets  # A placeholder: the preset's own stands.
    sets = [s for s in sets if not s.startswith("init=/path/to/")]
    assert main(["show-config", "--config", config, "--set", *sets]) == 0
    assert "backend: ray" in capsys.readouterr().out


def test_the_examples_are_the_readmes():
    """examples/my_tools.py's Echo is the README's, its data loads as a JSONL task whose
    answers are right, and its reward scores as the README says."""
    from gac_jax.tasks.custom import load_jsonl

    def echo(source: str) -> str:
        (node,) = [n for n in ast.parse(source).body if getattr(n, "name", "") == "Echo"]
        return ast.dump(node)

    (readme_echo,) = [b for b in _blocks("python") if "class Echo" in b]
    assert echo(readme_echo) == echo((REPO / "examples/my_tools.py").read_text())
    for split in ("train", "test"):
        rows = load_jsonl(REPO / f"examples/data/{split}.jsonl")
        for row in rows:
            a, b = map(int, re.fullmatch(r"What is (\d+)\+(\d+)\?", row["prompt"]).groups())
            assert row["answer"] == str(a + b) and row["system"] == "Reply with a number."
    score = runpy.run_path(str(REPO / "examples/my_rewards.py"))["score"]
    example = {"answer": "12"}
    assert score("12", example) == 1.0 and score(" 12 and 3", example) == 1.0
    assert score("3 then 12", example) == 0.1 and score("121", example) == 0.1
    assert score("no number", example) == 0.0 and score("", example) == 0.0


@pytest.mark.slow
def test_the_example_scripts_run(capsys):
    """`python examples/chat_tool_call.py` and `python examples/my_tools.py`, as the README
    names them."""
    for script in ("chat_tool_call.py", "my_tools.py"):
        assert f"`python examples/{script}`" in _text()
    runpy.run_path(str(REPO / "examples/chat_tool_call.py"), run_name="__main__")
    expected = "\n<|im_start|>user\n<tool_response>\n12\n</tool_response><|im_end|>\n"
    assert capsys.readouterr().out.strip() == repr(expected + "<|im_start|>assistant\n")
    rows = runpy.run_path(str(REPO / "examples/my_tools.py"))["main"]()
    assert len(rows.turns) == 4 and (rows.policy_mask.sum(1) > 0).all()
    assert "turns per episode" in capsys.readouterr().out
