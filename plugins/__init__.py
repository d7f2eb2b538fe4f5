"""textgym's built-in reward plugins, one per file, each registered through ``register_rewards``."""
