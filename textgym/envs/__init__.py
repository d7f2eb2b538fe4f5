"""Text-generation environments."""

from textgym.envs.textgen import TextGenEnv, TextGenVectorEnv

__all__ = ["TextGenEnv", "TextGenVectorEnv"]
