"""The environment of the README's "Multi-turn and tools": `env=my_tools:Echo` with
`PYTHONPATH=examples`. `python examples/my_tools.py` runs four episodes of it by hand on a
random tiny model, with the run's own `EpisodeRunner` (the one sampler, the guard)."""

from gac_jax.tasks.environments import Observation


class Echo:
    turn_end = (">",)                     # A turn ends when the policy writes one.

    def start(self, example):             # An episode's own state.
        return {"turns": 0}

    def step(self, state, turn):          # The turn's text -> an observation (or done=True).
        state["turns"] += 1
        return Observation(turn[-4:])

    def reward(self, state, transcript, example):
        return float(state["turns"] >= 1)


def main():
    import jax
    from flax import nnx

    from gac_jax import models
    from gac_jax.rollout.episodes import EpisodeConfig, EpisodeRunner
    from gac_jax.rollout.generation import GenerationConfig, make_sampler
    from gac_jax.rollout.sampling import SampleSettings

    tokenizer = models.CharTokenizer()
    model = models.create_model(models.get_config("tiny"), seed=0)
    sampler = make_sampler(model.config, tokenizer, GenerationConfig(max_new_tokens=32))
    runner = EpisodeRunner(sampler, tokenizer, Echo(), EpisodeConfig(max_turns=3))
    graphdef, params = nnx.split(model)
    prompts = [tokenizer.encode("12*34+5?", add_bos=True)] * 4
    settings = SampleSettings(prompt_length=16, sampling={"temperature": 2.0}, chunk_steps=8)
    key = jax.random.key(0)
    rows = runner.sample(graphdef, lambda: (params, 0), prompts, [{}] * 4, key, settings)
    print("turns per episode", rows.turns, "policy tokens", rows.policy_mask.sum(1),
          "observation tokens", rows.observation_mask.sum(1))
    return rows


if __name__ == "__main__":
    main()
