"""Bridges between textgym and other libraries. Each submodule imports nothing of its library, so textgym
never depends on it: ``textgym.integrations.trl`` speaks TRL's reward-function signature."""
