"""textgym's agents, one per file, each registered through ``register_agents``."""
