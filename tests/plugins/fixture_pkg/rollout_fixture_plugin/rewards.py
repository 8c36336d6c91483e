"""A reward function plugin: `fixture_len`."""


def length_reward(prompts, completions, **fields):
    """The completion's length in characters."""
    return [float(len(c)) for c in completions]
