"""Where a person waits, the run says what it does (issue #63): a run's first step names
what it compiles (the evaluation's sampler, the rollouts' sampler, the learner step) before
the first progress line, and `gac-jax eval` says each part and each sampler call. A real
tiny run through the CLI."""

from gac_jax.train.cli import main

SMALL = [
    "task=arithmetic/add2", "init=random", "steps=2", "eval_every=0", "eval_at_start=true",
    "eval_size=3", "eval_samples=2", "checkpoint_every=2", "rollout.mode=sync",
    "rollout.groups_per_batch=2", "generation.group_size=2", "generation.prompt_length=12",
    "generation.max_new_tokens=4", "mesh.data=1",
]  # fmt: skip


def test_the_first_step_and_eval_say_what_they_compile_and_sample(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--set", *SMALL, f"data_dir={tmp_path}", "--out", str(run)]) == 0
    lines = capsys.readouterr().err.splitlines()
    said = [
        "evaluating the initial policy (compiling the sampler for evaluation)",
        "step 0: compiling the sampler and making the first rollouts",
        "step 0: compiling the learner step",
        "step 1/2",
    ]
    at = [next(i for i, line in enumerate(lines) if line.startswith(s)) for s in said]
    assert at == sorted(at), lines
    assert sum("compiling" in line for line in lines) == 3  # The second step compiles nothing.

    assert main(["eval", "--checkpoint", str(run)]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "eval: building the run (model, tokenizer, data) and loading the checkpoint",
        "eval: step 2: the first sampler call compiles the sampler",
        "eval: greedy answers: rows 1-3 of 3",
        "eval: 2 samples a problem: rows 1-6 of 6",
    ]
