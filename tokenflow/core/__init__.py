"""The paper's core: the reader's buffer, the policy and its baselines, the
knobs, the meters and the scheduler's typed summary. Pure Python: no vLLM,
no Ray, so every formula can be read and tested on its own."""
